"""`torch.tpu`: the device module PyTorch looks up for the renamed PrivateUse1 backend.

It mirrors the parts of `torch.cuda` that training code, autocast, FSDP and
FakeTensor call. PJRT orders work on one queue per device, so a Stream is the
device's single queue and an Event records a point on it.
"""
from __future__ import annotations

import contextlib
import time

import torch

from . import _C

_initialized = False


def _lazy_init() -> None:
    global _initialized
    _C._check_not_forked()  # as CUDA: a child forked after the runtime started cannot use it
    if not _initialized:
        _C._device_count()  # starts the runtime; raises with the plugin's message
        _initialized = True


def is_available() -> bool:
    try:
        return _C._device_count() > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return _C._runtime_started()


def _is_in_bad_fork() -> bool:
    """True in a child forked after the tpu runtime started: device work raises there."""
    return _C._is_in_bad_fork()


def device_count() -> int:
    return _C._device_count()


def current_device() -> int:
    return _C._current_device()


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "tpu":
        raise ValueError(f"expected a tpu device, got {device}")
    return current_device() if device.index is None else device.index


def set_device(device) -> None:
    _C._set_device(_index(device))


@contextlib.contextmanager
def device(device):
    previous = current_device()
    set_device(device)
    try:
        yield
    finally:
        _C._set_device(previous)


def synchronize(device=None) -> None:
    """Waits for every tpu program enqueued so far; raises if one failed."""
    _C._synchronize()


def get_device_name(device=None) -> str:
    info = _C._platform()
    return f"{info['device_kind']} ({info['name']})"


def get_amp_supported_dtype():
    """The dtypes torch.autocast("tpu") casts to: both run on every PJRT plugin
    (XLA computes them natively or in f32), and matmuls/convolutions accumulate
    in f32 (csrc/aten/autocast.cpp has the cast policy)."""
    return [torch.bfloat16, torch.float16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """bfloat16 tensors, ops and autocast work on every tpu device."""
    return is_available()


# ---- RNG: a counter-based (seed, offset) pair per device, like CUDA's Philox.
def manual_seed(seed: int) -> None:
    _C._manual_seed(current_device(), int(seed) & 0xFFFFFFFFFFFFFFFF)


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C._manual_seed(i, int(seed) & 0xFFFFFFFFFFFFFFFF)


def seed() -> None:
    manual_seed(torch.randint(0, 2**62, ()).item())


def seed_all() -> None:
    manual_seed_all(torch.randint(0, 2**62, ()).item())


def initial_seed() -> int:
    return _C._rng_state(current_device())[0]


def get_rng_state(device="tpu") -> torch.Tensor:
    seed_, offset = _C._rng_state(_index(device))
    return torch.tensor([seed_, offset], dtype=torch.uint64).view(torch.uint8)


def set_rng_state(new_state: torch.Tensor, device="tpu") -> None:
    if new_state.dtype != torch.uint8 or new_state.numel() != 16:
        raise ValueError("a tpu RNG state is a uint8 tensor of 16 bytes (from torch.tpu.get_rng_state())")
    seed_, offset = new_state.contiguous().view(torch.uint64).tolist()
    _C._set_rng_state(_index(device), seed_, offset)


def get_rng_state_all():
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for i, state in enumerate(states):
        set_rng_state(state, i)


# ---- Memory: bytes held by live tpu storages (a storage's buffer is freed
# with it; nothing is cached, so reserved equals allocated). The same numbers
# as torch.accelerator.memory_stats() when tpu is the current accelerator.
def memory_allocated(device=None) -> int:
    return _C._memory_allocated(_index(device))


def max_memory_allocated(device=None) -> int:
    return _C._max_memory_allocated(_index(device))


def memory_reserved(device=None) -> int:
    return memory_allocated(device)


def max_memory_reserved(device=None) -> int:
    return max_memory_allocated(device)


def reset_peak_memory_stats(device=None) -> None:
    _C._reset_peak_memory(_index(device))


def reset_max_memory_allocated(device=None) -> None:
    reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=None) -> None:
    torch._C._accelerator_resetAccumulatedStats(_index(device))


def memory_stats(device=None) -> dict:
    """torch.cuda.memory_stats()'s keys ("allocated_bytes.all.current", ...) over live tpu storages."""
    i = _index(device)
    stats = dict(torch.accelerator.memory_stats(i)) if is_initialized() else {}
    stats["allocated_bytes.all.current"] = _C._memory_allocated(i)
    stats["allocated_bytes.all.peak"] = _C._max_memory_allocated(i)
    return stats


def empty_cache() -> None:
    """Buffers are freed as soon as their storage dies; there is no cache to empty."""


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- Streams and events over the device's single queue.
class Stream:
    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device("tpu", _index(device))
        self.priority = priority

    def synchronize(self) -> None:
        synchronize()

    def wait_stream(self, stream) -> None:
        """One queue per device: work is already ordered."""

    def wait_event(self, event) -> None:
        """One queue per device: work is already ordered."""

    def query(self) -> bool:
        synchronize()
        return True

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __eq__(self, other):
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self):
        return hash(self.device)


class Event:
    def __init__(self, enable_timing: bool = False, **kwargs):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None) -> None:
        if self.enable_timing:
            synchronize()
            self._time = time.perf_counter()

    def synchronize(self) -> None:
        synchronize()

    def wait(self, stream=None) -> None:
        """One queue per device: work is already ordered."""

    def query(self) -> bool:
        synchronize()
        return True

    def elapsed_time(self, end: "Event") -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time needs both events created with enable_timing=True and recorded")
        return (end._time - self._time) * 1000.0


def current_stream(device=None) -> Stream:
    return Stream(device)


def default_stream(device=None) -> Stream:
    return Stream(device)


@contextlib.contextmanager
def stream(stream):
    yield
