"""accelerate, and so the HF Trainer, on `tpu`: data-parallel under torchrun / `accelerate launch`.

accelerate picks its distributed type from a fixed table of device types (TORCH_DISTRIBUTED_BACKENDS in
accelerate/utils/constants.py) and `DistributedType(f"MULTI_{type}")`. Without a `tpu` entry a process started
by torchrun with WORLD_SIZE=2 becomes DistributedType.NO and trains alone on its half of the launch. This
module, installed by `import torch_pjrt`, adjusts accelerate when (and if) its modules are imported; the user's
script does not change (see docs/design/distributed.md, "accelerate and the HF Trainer"):

- `tpu` -> `tpu_dist` in TORCH_DISTRIBUTED_BACKENDS, and the value MULTI_TPU looks up DistributedType.MULTI_GPU:
  accelerate's generic accelerator path (init_process_group, DDP wrapping, gather/reduce, barrier, RNG sync,
  FSDP, mixed precision). Its every other MULTI_* member is listed in inline tuples all over accelerate, so a
  new member would be left out of all of them; MULTI_GPU's only CUDA-specific step, set_device, is replaced.
- PartialState.set_device: tpu:(LOCAL_RANK % device count) (what distributed.py binds at import).
- PartialState.wait_for_everyone: the barrier on this process's device, not on tpu:(local rank).
- Accelerator.prepare_model: DDP's device_ids is the process's device index, not its local rank (on the
  CPU plugin every process owns tpu:0; accelerate assumes the CUDA layout, local rank r on device r).
- `accelerate launch --num_processes N` with one visible device runs N processes (each process opens its own
  devices), where accelerate would start a single one.
- DynamoBackend gets TPU: Trainer(torch_compile_backend="tpu"); the launcher's own DYNAMO_BACKENDS list (its
  argparse choices) too, so `accelerate launch --dynamo_backend tpu` is accepted.
- The safety net: a process on `tpu` with WORLD_SIZE > 1 that accelerate left non-distributed raises.
- accelerate refuses fp16 on `tpu` inside Accelerator.__init__ (it assumes TorchTPU's missing GradScaler op);
  that check cannot be reached from outside, so the refusal is re-raised with the working alternatives.

Nothing here imports accelerate: a post-import hook on sys.meta_path patches its modules as they load, and
install() patches those already loaded. torch_pjrt is often imported in the middle of accelerate's own import
(`import accelerate` imports torch from accelerate.accelerator, and an installed torch_pjrt loads with torch), so
a module still initializing is patched as soon as it has finished (see _Finder). `python -m
accelerate.commands.launch` runs the launcher as __main__ (runpy never calls exec_module): _PatchingLoader.get_code
runs the patched module instead.
"""
from __future__ import annotations

import functools
import importlib.abc
import os
import sys
import warnings

import torch

from ._after_import import PatchingLoader, spec_with_patch

_BACKEND = "tpu_dist"
_FP16_REFUSAL = "fp16 mixed precision is not supported on 'tpu'"


def _on_tpu() -> bool:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type == "tpu"


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _wrap(owner, name: str, make):
    """Replaces owner.name by make(original) once (a module imported twice, or install() run twice, keeps one)."""
    original = owner.__dict__.get(name)
    if original is None or getattr(original, "_torch_pjrt_wrapped", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper._torch_pjrt_wrapped = True
    setattr(owner, name, wrapper)


def _add_enum_member(cls, name: str, value: str) -> None:
    """A new member of a str-valued Enum, found by value, by name and by iteration (Python keeps no API for it)."""
    if value in cls._value2member_map_:
        return
    member = cls._member_type_.__new__(cls, value) if cls._member_type_ is not object else object.__new__(cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls
    cls._member_names_.append(name)
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to rebind members; this is a new one


# -- the patches, one per accelerate module --------------------------------------------------------------


def _patch_constants(module) -> None:
    """accelerate.utils.constants: the device table (mutated in place: accelerate's other modules hold the dict)."""
    if torch.distributed.is_available():
        module.TORCH_DISTRIBUTED_BACKENDS.setdefault("tpu", _BACKEND)


def _patch_dataclasses(module) -> None:
    """accelerate.utils.dataclasses: the enums."""
    DistributedType = module.DistributedType
    # _prepare_backend's DistributedType("MULTI_TPU") finds the generic accelerator type.
    DistributedType._value2member_map_.setdefault("MULTI_TPU", DistributedType.MULTI_GPU)
    _add_enum_member(module.DynamoBackend, "TPU", "TPU")


def _patch_config_utils(module) -> None:
    """accelerate.commands.config.config_utils: DYNAMO_BACKENDS, the list `accelerate launch --dynamo_backend`
    takes its argparse choices from (a list of its own, not the enum); extended in place before any parser is
    built, so `--dynamo_backend tpu` is accepted."""
    if "TPU" not in module.DYNAMO_BACKENDS:
        module.DYNAMO_BACKENDS.append("TPU")


def _patch_state(module) -> None:
    PartialState = module.PartialState
    DistributedType = module.DistributedType

    def make_set_device(original):
        def set_device(self):
            if self.device is None and self.distributed_type == DistributedType.MULTI_GPU and not self._cpu \
                    and _on_tpu():
                index = self.local_process_index % max(torch.tpu.device_count(), 1)
                torch.tpu.set_device(index)
                self.device = torch.device("tpu", index)
                return
            return original(self)
        return set_device

    def make_init(original):
        def __init__(self, cpu: bool = False, **kwargs):
            _apply_finished()  # accelerate.accelerator, if no import came after its own (see _Finder)
            original(self, cpu, **kwargs)
            world = _world_size()
            if world > 1 and self.distributed_type == DistributedType.NO and not cpu \
                    and getattr(self, "device", None) is not None and self.device.type == "tpu":
                device = self.device
                PartialState._reset_state()  # no half-made state for a retry in this process
                raise RuntimeError(
                    f"torch_pjrt: this process was launched as one of WORLD_SIZE={world}, but accelerate set it up "
                    f"non-distributed (DistributedType.NO) on {device}: it would train alone on its share of "
                    "the data. LOCAL_RANK="
                    f"{os.environ.get('LOCAL_RANK')!r}: launch with `torchrun --nproc-per-node N` or "
                    "`accelerate launch --num_processes N` (which set LOCAL_RANK, RANK, WORLD_SIZE), and import "
                    "torch_pjrt (or install it, so that `import torch` loads it) before accelerate creates its "
                    "state. See docs/design/distributed.md.")
        return __init__

    def make_wait(original):
        def wait_for_everyone(self):
            # accelerate's barrier names device [local rank], which on tpu need not exist: name this process's.
            if self.distributed_type in (DistributedType.MULTI_GPU, DistributedType.FSDP) \
                    and getattr(self, "device", None) is not None and self.device.type == "tpu":
                torch.distributed.barrier(device_ids=[self.device.index])
                return
            return original(self)
        return wait_for_everyone

    _wrap(PartialState, "set_device", make_set_device)
    _wrap(PartialState, "wait_for_everyone", make_wait)
    _wrap(PartialState, "__init__", make_init)


def _patch_accelerator(module) -> None:
    Accelerator = module.Accelerator

    def make_prepare_model(original):
        def prepare_model(self, model, *args, **kwargs):
            prepared = original(self, model, *args, **kwargs)
            ddp = getattr(prepared, "_orig_mod", prepared)  # torch.compile'd after wrapping
            device = self.device
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and device.type == "tpu" \
                    and ddp.device_ids is not None and ddp.device_ids != [device.index]:
                # accelerate passes device_ids=[local rank]; DDP only moves inputs to device_ids[0].
                ddp.device_ids = [device.index]
                ddp.output_device = device.index
            return prepared
        return prepare_model

    def make_init(original):
        def __init__(self, *args, **kwargs):
            try:
                original(self, *args, **kwargs)
            except ValueError as e:
                if _FP16_REFUSAL not in str(e):
                    raise
                raise ValueError(
                    "accelerate refuses fp16 mixed precision on 'tpu' in Accelerator.__init__ (it assumes TorchTPU, "
                    "whose GradScaler lacks _amp_foreach_non_finite_check_and_unscale_); torch_pjrt's tpu has that "
                    "op, but the check cannot be changed from outside accelerate. Use bf16 (mixed_precision='bf16', "
                    "TrainingArguments(bf16=True), `accelerate launch --mixed_precision bf16`), which needs no loss "
                    "scaling, or a loop of your own with torch.autocast('tpu', dtype=torch.float16) and "
                    "torch.amp.GradScaler('tpu').") from e
        return __init__

    _wrap(Accelerator, "prepare_model", make_prepare_model)
    _wrap(Accelerator, "__init__", make_init)


def _patch_launch(module) -> None:
    def make_validate(original):
        def _validate_launch_command(args):
            args, defaults, mp_from_config = original(args)
            # accelerate starts N processes only when it sees more than one device; on tpu each process opens its
            # own (the CPU plugin: its own client), so N processes asked for are N processes run.
            alone = not (args.multi_gpu or args.tpu or args.use_deepspeed or args.use_fsdp
                         or getattr(args, "use_megatron_lm", False) or args.cpu or getattr(args, "use_cpu", False))
            if alone and (args.num_processes or 1) > 1 and _on_tpu():
                args.multi_gpu = True
            return args, defaults, mp_from_config
        return _validate_launch_command

    _wrap(module, "_validate_launch_command", make_validate)


_PATCHES = {  # module -> its patch, run right after the module's own code
    "accelerate.utils.constants": _patch_constants,
    "accelerate.utils.dataclasses": _patch_dataclasses,
    "accelerate.commands.config.config_utils": _patch_config_utils,
    "accelerate.state": _patch_state,
    "accelerate.accelerator": _patch_accelerator,
    "accelerate.commands.launch": _patch_launch,
}


def _apply(name: str, module) -> None:
    try:
        _PATCHES[name](module)
    except Exception as e:  # a changed accelerate: say so; the safety net may still be in place
        warnings.warn(f"torch_pjrt: could not adapt {name} for tpu ({type(e).__name__}: {e}); distributed training "
                      "through accelerate may not work on tpu", RuntimeWarning, stacklevel=2)


_waiting: set[str] = set()  # modules found mid-import by install(), patched once they have finished


def _initializing(module) -> bool:
    # importlib's own flag (read by its module locking) for a module whose code is still running.
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _apply_finished() -> None:
    """Patches the waiting modules that have finished initializing."""
    for name in [n for n in _waiting if not _initializing(sys.modules.get(n))]:
        _waiting.discard(name)
        if name in sys.modules:
            _apply(name, sys.modules[name])


# What `python -m <patched module>` runs as __main__: the module imported under its own name (so patched), its
# names in __main__, and its main guard. Only the launcher has one.
_RUN_AS_MAIN = {"accelerate.commands.launch"}
_MAIN_CODE = """
import importlib
_module = importlib.import_module({name!r})
globals().update((k, v) for k, v in vars(_module).items() if not k.startswith("__"))
if __name__ == "__main__":
    _module.main()
"""


class _PatchingLoader(PatchingLoader):
    def get_code(self, fullname):
        # Only runpy (`python -m`) asks this loader for code: imports go through exec_module, whose inner
        # loader reads its own code. Run as __main__, the module's code would call main() before any patch.
        if fullname in _RUN_AS_MAIN:
            return compile(_MAIN_CODE.format(name=fullname), f"<torch_pjrt: python -m {fullname}>", "exec")
        return self._loader.get_code(fullname)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the other finders and runs the patch after the module's own code.

    Every import of a module not yet loaded asks this finder first, so it is also where a module that install()
    found mid-import (accelerate.accelerator when accelerate's import brings in torch, and torch torch_pjrt) gets
    its patch: accelerate's next import comes after it has finished."""

    def find_spec(self, name, path, target=None):
        if _waiting:
            _apply_finished()
        if name not in _PATCHES:
            return None
        return spec_with_patch(self, name, path, target, _PatchingLoader, _apply)


def install() -> None:
    """Patches the accelerate modules already imported (or once they finish importing) and those imported later."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in _PATCHES:
        module = sys.modules.get(name)
        if module is None:
            continue
        if _initializing(module):
            _waiting.add(name)  # its classes are not defined yet: patching now is the circular import
        else:
            _apply(name, module)
