"""`torch.tpu`: the device module PyTorch looks up for the renamed PrivateUse1 backend.

It mirrors the parts of `torch.cuda` that training code, autocast, FSDP and
FakeTensor call, streams and events included (docs/design/streams.md).
"""
from __future__ import annotations

import contextlib

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
    """Runs the device's pending fused graph and waits for every program
    enqueued on it so far (device None: the current device, as torch.cuda);
    raises if one failed or a runtime check did."""
    _C._synchronize(_index(device))


def get_device_name(device=None) -> str:
    info = _C._platform()
    return f"{_C._device_kind(_index(device))} ({info['name']})"


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


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device, as torch.cuda.mem_get_info: from the
    plugin's memory statistics, or the host's memory where the device's memory
    is host memory (the CPU plugin reports none)."""
    _lazy_init()
    return tuple(_C._memory_info(_index(device)))  # device.cpp: memory_info, also torch.accelerator.get_memory_info


class _DeviceProperties:
    """What torch.cuda.get_device_properties gives that code reads: name,
    total_memory, major/minor and the multiprocessor count (TorchTitan's memory
    monitor, accelerate's and transformers' device checks)."""

    def __init__(self, index: int):
        kind = _C._device_kind(index)
        platform = _C._platform()["name"]
        self.name = kind
        self.type = "tpu"
        self.platform = platform
        self.total_memory = mem_get_info(index)[1]
        self.major, self.minor = _capability(kind, platform, index)
        self.multi_processor_count = 1  # PJRT does not say; one program runs on one device
        self.is_integrated = platform == "cpu"

    def __repr__(self) -> str:
        return (f"_TpuDeviceProperties(name='{self.name}', platform='{self.platform}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // (1 << 20)}MB)")


def _capability(kind: str, platform: str, index: int) -> tuple[int, int]:
    """TPU: the generation in the device kind ("TPU v5 lite" -> (5, 0)); GPU: CUDA's compute
    capability of the same device where torch.cuda can say; the CPU plugin: (0, 0)."""
    import re

    if platform == "tpu":
        m = re.search(r"v(\d+)", kind)
        return (int(m.group(1)), 0) if m else (0, 0)
    if platform == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(index)
    return 0, 0


def get_device_properties(device=None) -> _DeviceProperties:
    _lazy_init()
    i = _index(device)
    _C._check_device_index(i)
    return _DeviceProperties(i)


def get_device_capability(device=None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def utilization(device=None) -> int:
    """Percent of time a program ran over the last sample period, where the
    plugin's platform can say (the CUDA plugin, through NVML as torch.cuda does)."""
    _lazy_init()
    if _C._platform()["name"] == "cuda" and torch.cuda.is_available():
        return torch.cuda.utilization(_index(device))
    raise RuntimeError(f"the {_C._platform()['name']} PJRT plugin does not report device utilization")


def memory_summary(device=None, abbreviated: bool = False) -> str:
    """A readable summary of the device's memory, as torch.cuda.memory_summary."""
    i = _index(device)
    mib = lambda n: f"{n / (1 << 20):,.1f} MiB"  # noqa: E731
    stats = memory_stats(i)
    free, total = mem_get_info(i)
    rows = [("allocated (live tpu storages)", mib(stats["allocated_bytes.all.current"])),
            ("peak allocated", mib(stats["allocated_bytes.all.peak"])),
            ("allocations", str(stats.get("allocation.all.current", "?"))),
            ("device free / total", f"{mib(free)} / {mib(total)}")]
    plugin = _C._device_memory_stats(i)
    if plugin is not None and not abbreviated:
        rows.append(("plugin: bytes in use", mib(plugin["bytes_in_use"])))
        if plugin["peak_bytes_in_use"] >= 0:
            rows.append(("plugin: peak bytes in use", mib(plugin["peak_bytes_in_use"])))
    width = max(len(name) for name, _ in rows)
    title = f"tpu:{i} memory summary ({get_device_name(i)})"
    return "\n".join([title, "=" * len(title)] + [f"{name.ljust(width)}  {value}" for name, value in rows])


OutOfMemoryError = torch.OutOfMemoryError


def init() -> None:
    """Starts the device runtime now (it starts on first use otherwise), as torch.cuda.init."""
    _lazy_init()


def empty_cache() -> None:
    """Buffers are freed as soon as their storage dies; there is no cache to empty."""


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- Streams and events: torch.Stream / torch.Event for the tpu device, backed
# by the device guard (device.cpp, streams.h). A stream names a sequence of work:
# each program or copy is tagged with the streams whose ops it carries, so
# query/synchronize/events see that stream's work. PJRT orders a device's work
# by its data, which is why wait_stream/wait_event on one device cost nothing.
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)  # c10::DeviceType, as torch.Stream(stream_id=) takes it


class Stream(torch.Stream):
    """A tpu stream. `Stream()` takes the next stream of the device's pool (normal or, with priority < 0,
    high priority), as torch.cuda.Stream does; current_stream() and default_stream() name existing ones."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs:  # wrapping an existing stream (current_stream, default_stream)
            return super().__new__(cls, stream_id=kwargs["stream_id"], device_index=_index(device),
                                   device_type=_PRIVATEUSE1)
        return super().__new__(cls, device=torch.device("tpu", _index(device)), priority=priority)

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    @property
    def priority(self) -> int:
        return _C._stream_priority(self.stream_id)

    @staticmethod
    def priority_range() -> tuple:
        """(lowest, highest) priority, as torch.cuda.Stream.priority_range()."""
        return (0, -1)

    def wait_stream(self, stream) -> None:
        self.wait_event(stream.record_event())

    def wait_event(self, event) -> None:
        event.wait(self)

    def record_event(self, event=None):
        event = event or Event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<torch.tpu.Stream device=tpu:{self.device_index} stream_id={self.stream_id} priority={self.priority}>"


def _wrap(s: torch.Stream) -> Stream:
    return Stream(s.device_index, stream_id=s.stream_id)


class Event:
    """A tpu torch.Event (kept as `.event`: torch.Event's elapsed_time and
    wait take torch.Event itself, not subclasses)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kwargs):
        self.event = torch.Event(device="tpu", enable_timing=enable_timing, blocking=blocking,
                                 interprocess=interprocess)

    @property
    def device(self):
        return self.event.device

    def record(self, stream=None) -> None:
        self.event.record(stream if stream is not None else current_stream())

    def wait(self, stream=None) -> None:
        self.event.wait(stream if stream is not None else current_stream())

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def elapsed_time(self, end: "Event") -> float:
        return self.event.elapsed_time(end.event if isinstance(end, Event) else end)


def current_stream(device=None) -> Stream:
    """This thread's current stream on `device` (the default stream unless one was set)."""
    _lazy_init()
    return _wrap(torch.accelerator.current_stream(_index(device)))


def default_stream(device=None) -> Stream:
    return Stream(device, stream_id=0)


def set_stream(stream) -> None:
    """Makes `stream` this thread's current stream on its device (None: no change, as torch.cuda.set_stream)."""
    if stream is None:
        return
    if getattr(getattr(stream, "device", None), "type", None) != "tpu":
        raise ValueError(f"expected a tpu stream, got {stream!r}")
    _C._check_device_index(_index(stream.device))
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream):
    """Work issued inside runs on `stream` (None: the current stream, as torch.cuda.stream)."""
    if stream is None:
        yield
        return
    before = current_stream(stream.device_index)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(before)
