"""torch_pjrt: the `tpu` device for PyTorch, compiled by XLA through PJRT.

    import torch, torch_pjrt
    x = torch.randn(3, device="tpu")

The plugin is chosen by TORCH_PJRT_PLUGIN: 'cpu' (default), 'cuda', 'tpu' or a
path to a PJRT plugin .so. The execution mode by TORCH_PJRT_MODE.
"""
from __future__ import annotations

from ._version import __version__


def _autoload() -> None:
    """The `torch.backends` entry point: `import torch` imports this package, which registers `tpu`.

    Defined before `import torch`: when the user imports torch_pjrt first, torch's
    autoload finds this half-imported module and calls this no-op, and the
    import goes on once torch is ready.
    """


import atexit
import contextlib
import functools
import os
import threading
import warnings

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _C
from . import _settings
from ._plugins import find_plugin, platform_of, prepare_environment
from . import device_module
from . import _decompositions
from . import _data_dependent
from . import _compile
from . import _failed_steps
from .device_loader import DeviceLoader

__all__ = ["DeviceLoader", "jax_op", "register_lowering", "op_traits", "set_mode", "get_mode", "mode", "thread_mode", "sync",
           "optimizer_step", "metrics", "metrics_report", "reset_metrics",
           "platform", "lowered_ops", "explain"]

MODES = ("debug", "strict", "fused", "lazy")


# Why the tpu device cannot be used in this process (a bad TORCH_PJRT_PLUGIN or
# TORCH_PJRT_MODE), None when it can. Import never raises for these: PyTorch
# imports this package at every `import torch` (the torch.backends entry point),
# and a bad setting must not break torch itself.
unavailable_reason: str | None = None


def _make_unavailable(reason: str) -> None:
    global unavailable_reason
    unavailable_reason = reason
    _C._configure_unavailable(reason)
    warnings.warn(f"torch_pjrt: the tpu device is unavailable: {reason}. `python -m torch_pjrt` diagnoses the set-up.",
                  RuntimeWarning, stacklevel=2)


def _configure_plugin() -> None:
    plugin = _settings.text("TORCH_PJRT_PLUGIN")
    try:
        path = find_plugin(plugin)
    except (OSError, ValueError, RuntimeError) as e:
        _make_unavailable(str(e) if "TORCH_PJRT_PLUGIN" in str(e) else f"TORCH_PJRT_PLUGIN={plugin!r}: {e}")
        return
    prepare_environment(platform_of(plugin))
    _C._configure_plugin(path, platform_of(plugin))


def _register() -> None:
    _configure_plugin()
    torch.utils.rename_privateuse1_backend("tpu")
    torch._register_device_module("tpu", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    _C._register_lowered_kernels()
    _C._register_graph_impl()
    _decompositions.register()
    _data_dependent.register()
    # Errors from fused graphs name the user's line: frames in these are skipped.
    import sysconfig
    library_dirs = [os.path.dirname(torch.__file__), os.path.dirname(__file__), sysconfig.get_paths()["stdlib"]]
    _C._install_location_hook([os.path.join(d, "") for d in library_dirs])
    # Registered at import, so it runs after the atexit hooks registered later
    # (DataLoader's): daemon threads still using the device stop there (interpreter_exit.cpp).
    atexit.register(_C._begin_interpreter_exit)


_register()
_compile.register()  # torch.compile(..., backend="tpu")
if torch.distributed.is_available():
    from . import distributed as _distributed
    _distributed.register()  # the c10d backend "tpu_dist"
else:
    _distributed = None
from . import _accelerate
_accelerate.install()  # accelerate / the HF Trainer on tpu: data-parallel under torchrun and `accelerate launch`
from . import _torchtitan
_torchtitan.install()  # torchtitan imports without Triton (its CUDA expert-parallel kernels)
from .serving import hf_batching
hf_batching.install()  # transformers' continuous batching sizes its cache from tpu memory
from . import torchtpu
torchtpu.install()  # TorchTPU's torch.tpu names (eager_mode, torch.tpu.pallas, torch.tpu.ops, ...): docs/torchtpu-compat.md
from . import helion as _helion
_helion.install()  # Helion kernels on tpu tensors run their Pallas JAX view inside the program


def _print_from_host() -> None:
    """Printing formats a CPU copy: one transfer instead of a program per slice."""
    import torch._tensor_str as tensor_str

    original = tensor_str._tensor_str

    def _tensor_str(self, indent):
        if self.device.type == "tpu":
            self = self.detach().cpu()
        return original(self, indent)

    tensor_str._tensor_str = _tensor_str


_print_from_host()


def set_mode(name: str) -> None:
    """The process's execution mode: every thread's, except inside a thread_mode() block.

    'fused' is the default.
    'debug': one op at a time, waits for each and checks it.
    'strict': one op at a time, asynchronous.
    'fused': ops are recorded and run as larger XLA graphs when data is needed,
      an op falls back to the CPU, the graph reaches TORCH_PJRT_FUSION_LIMIT ops, or at sync().
    'lazy': like fused, but graphs run only at sync() or when data is needed.
    """
    if name not in MODES:
        raise ValueError(f"unknown torch_pjrt mode {name!r}: expected one of {MODES}")
    _C._set_mode(name)


def get_mode() -> str:
    """The calling thread's execution mode: its thread_mode() block's, else the process's."""
    return _C._get_mode()


@contextlib.contextmanager
def mode(name: str):
    """The process's mode is `name` for the block (every thread's, as set_mode)."""
    previous = _C._get_process_mode()
    set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)


@contextlib.contextmanager
def thread_mode(name: str):
    """The calling thread runs its ops in mode `name` for the block; other threads keep theirs.

    Switching runs what the thread's previous mode recorded. set_mode() inside
    the block changes the process's mode, which the thread gets back after it.
    Threads started inside the block, and autograd's device thread that runs a
    tpu backward, run in the process's mode.
    """
    if name not in MODES:
        raise ValueError(f"unknown torch_pjrt mode {name!r}: expected one of {MODES}")
    previous = _C._set_thread_mode(name)
    try:
        yield
    finally:
        _C._set_thread_mode(previous)


if _settings.text("TORCH_PJRT_MODE") != get_mode() and unavailable_reason is None:
    try:
        set_mode(_settings.text("TORCH_PJRT_MODE"))
    except ValueError as e:  # a typo must not run the user's job in another mode
        _make_unavailable(f"TORCH_PJRT_MODE={_settings.text('TORCH_PJRT_MODE')!r}: {e}")


def sync() -> None:
    """Runs the ops recorded so far (fused and lazy modes) without waiting for them."""
    _C._sync()


def _end_of_step(optimizer, args, kwargs) -> None:
    # Fused mode cuts graphs at optimizer steps: every training step is then
    # the same graph, compiled once, whatever the loop reads in between.
    if torch.compiler.is_compiling():  # traced by Dynamo: the compiled step is one graph anyway
        return
    global _stepped_since_backward
    _stepped_since_backward = True
    # The undo first: it names the program the sync below launches, and a sync
    # that raises must not lose it.
    _failed_steps.restore_step_counts_if_failed(optimizer)
    if _C._get_mode() == "fused" and not _C._is_in_bad_fork():
        _C._sync()


_failed_steps.install()
register_optimizer_step_post_hook(_end_of_step)


def _host_step_counts(optimizer) -> bool:
    """Whether the optimizer keeps a step count on the host (a CPU 'step' tensor) for a tpu parameter."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step") if p.device.type == "tpu" else None
            if isinstance(step, torch.Tensor) and step.device.type == "cpu":
                return True
    return False


def _capture_check(optimizer, args, kwargs) -> None:
    # A captured step replays without Python: an optimizer whose step count
    # and bias corrections are host numbers (capturable=False, or one with no
    # capturable option such as Adagrad) would replay the capture's numbers
    # forever. PyTorch makes this check for CUDA and XPU only.
    if torch.compiler.is_compiling() or not _C._capturing():
        return
    why = None
    if not all(group.get("capturable", True) for group in optimizer.param_groups):
        why = "param_groups' capturable is False: construct it with capturable=True"
    elif _host_step_counts(optimizer):
        why = "it keeps its step count on the host (a CPU 'step' tensor), which a replay would not advance"
    if why is not None:
        message = f"Attempting tpu graph capture of step() for an instance of {type(optimizer).__name__} but {why}"
        _C._fail_capture(torch.tpu.current_device(), message)
        raise RuntimeError(message)


register_optimizer_step_pre_hook(_capture_check)
register_optimizer_step_post_hook(_capture_check)  # the first step makes the state it checks

# Inference has no optimizer step: fused mode also cuts the graph when an
# outermost module call returns with autograd off, so an evaluation loop is
# one repeating graph per batch rather than arbitrary cuts at the op limit.
# The hooks that see it are the module's own, put on the module a `.to("tpu")`
# (or any other `_apply`: `.tpu()`, `.to_empty()`, `.half()`) was called on
# when it ends up holding tpu tensors: global module hooks would make every
# `torch.compile(module)` in the process warn and send every module call, CPU
# ones included, through nn.Module's slow hook path.
_module_calls = threading.local()  # depth of nested calls of hooked modules, per thread


def _module_enter(module, args) -> None:
    if torch.compiler.is_compiling():  # traced by Dynamo: nothing to cut inside a compiled graph
        return
    _module_calls.depth = getattr(_module_calls, "depth", 0) + 1


def _module_exit(module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    depth = max(getattr(_module_calls, "depth", 1) - 1, 0)
    _module_calls.depth = depth
    # A forked DataLoader worker that runs modules on the CPU must not touch
    # the graph it inherited from the parent.
    if depth == 0 and _C._get_mode() == "fused" and not _C._is_in_bad_fork():
        _C._cut_long() if torch.is_grad_enabled() else _C._sync()


def _holds_device_tensors(module) -> bool:
    return any(t.device.type == "tpu" for t in module.parameters()) or \
        any(t.device.type == "tpu" for t in module.buffers())


def _update_cut_hooks(module) -> None:
    """The end-of-inference cut on the calls of a module that holds tpu tensors, once (a deep copy keeps the
    hooks it copied); off again when it moves elsewhere."""
    hooked = _module_exit in module._forward_hooks.values()
    if _holds_device_tensors(module):
        if not hooked:
            module.register_forward_pre_hook(_module_enter)
            module.register_forward_hook(_module_exit, always_call=True)
    elif hooked:
        _remove_cut_hooks(module)


def _remove_cut_hooks(module) -> bool:
    """Takes the cut hooks off `module`; whether it had them."""
    hooked = False
    for hooks, fn in ((module._forward_pre_hooks, _module_enter), (module._forward_hooks, _module_exit)):
        for key in [k for k, f in hooks.items() if f is fn]:
            del hooks[key]
            module._forward_hooks_always_called.pop(key, None)
            hooked = True
    return hooked


_jit_script = torch.jit.script


@functools.wraps(_jit_script)
def _script(obj, *args, **kwargs):
    # TorchScript compiles a module's hooks too, and ours are Python (they keep
    # per-thread state): script the module without them, then put them back.
    if not isinstance(obj, torch.nn.Module):
        return _jit_script(obj, *args, **kwargs)
    hooked = [m for m in obj.modules() if _module_exit in m._forward_hooks.values()]
    for m in hooked:
        _remove_cut_hooks(m)
    try:
        return _jit_script(obj, *args, **kwargs)
    finally:
        for m in hooked:
            m.register_forward_pre_hook(_module_enter)
            m.register_forward_hook(_module_exit, always_call=True)


torch.jit.script = _script


def _updating_cut_hooks_after(method):
    """`method` of nn.Module, then the cut hooks updated on the outermost module it was called on (the one the
    user calls): nested calls on its children (a per-thread depth per method) leave theirs alone."""
    calls = threading.local()

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        depth = getattr(calls, "depth", 0)
        calls.depth = depth + 1
        try:
            result = method(self, *args, **kwargs)
        finally:
            calls.depth = depth
        if depth == 0 and isinstance(self, torch.nn.Module):
            _update_cut_hooks(self)
        return result

    return wrapper


# Moved (`.to("tpu")`, `.tpu()`, `.to_empty()`, `.half()`: every `_apply`), or, for a model built on the device
# (`with torch.device("tpu"):`, `Model(device="tpu")`) that is never moved, `eval()` / `train()` (HF's
# from_pretrained and every evaluation loop call it on the model the user calls).
torch.nn.Module._apply = _updating_cut_hooks_after(torch.nn.Module._apply)
torch.nn.Module.train = _updating_cut_hooks_after(torch.nn.Module.train)

# Loops with nothing read and no cut point (gradcheck runs the model once per perturbed element with
# autograd on, then one backward pass per output element) were cut only at the op limit, at a different
# op each time, so no graph repeated. At an outermost module return with autograd on and at the end of a
# backward pass, fused mode cuts a graph that is at least half the limit: graphs hold whole iterations.
# A training loop cuts at its optimizer step instead: a backward end with an
# optimizer step since the one before it does not cut, so a step of forward,
# backward and optimizer stays one graph (and one program) whatever its size.
_stepped_since_backward = True


def _after_backward() -> None:
    global _stepped_since_backward
    stepped, _stepped_since_backward = _stepped_since_backward, False
    if stepped or torch.compiler.is_compiling() or _C._get_mode() != "fused" or _C._is_in_bad_fork():
        return
    _C._cut_long()


def _wrap_engine_run_backward() -> None:
    original = getattr(torch.autograd, "_engine_run_backward", None)
    if original is None or getattr(original, "_torch_pjrt", False):
        return

    @functools.wraps(original)
    def run_backward(*args, **kwargs):
        result = original(*args, **kwargs)
        _after_backward()
        return result

    run_backward._torch_pjrt = True
    torch.autograd._engine_run_backward = run_backward  # what torch.autograd.backward and grad call
    # torch's own engine patches (non-strict export) restore the name from here.
    torch.autograd.graph._engine_run_backward = run_backward


_wrap_engine_run_backward()


def optimizer_step(optimizer, **kwargs):
    """optimizer.step(**kwargs), then sync(): the torch_xla idiom for lazy mode."""
    result = optimizer.step(**kwargs)
    sync()
    return result


def metrics() -> dict:
    """Counters since start (or reset_metrics()): compiles, cache hits, executions, transfers, CPU fallbacks per op,
    and torch.distributed collectives (dist_*: staged through Gloo or in XLA, bytes staged each way)."""
    m = _C._metrics()
    if _distributed is not None:
        m.update(_distributed.counters())
    return m


def reset_metrics() -> None:
    _C._reset_metrics()
    if _distributed is not None:
        _distributed.reset_counters()


def metrics_report() -> str:
    m = metrics()
    lines = [
        f"compiles: {m['compiles']} ({m['compile_seconds']:.3f}s), compile cache hits: {m['compile_cache_hits']}",
        f"op signatures: {m['op_cache_misses']} new, {m['op_cache_hits']} reused; executions: {m['executions']}",
        f"fused graphs: {m['graphs']} run ({m['graph_cache_hits']} found by structure), {m['fused_ops']} ops recorded",
        f"disk cache: {m['disk_cache_hits']} hits, {m['disk_cache_misses']} misses, {m['disk_cache_writes']} writes, "
        f"{m['disk_cache_corrupt']} corrupt",
        f"transfers: {m['host_to_device_bytes']} B to device, {m['device_to_host_bytes']} B to host",
    ]
    if "dist_collectives_staged" in m:
        lines.append(f"distributed: {m['dist_collectives_staged']} collectives staged through gloo "
                     f"({m['dist_staged_bytes_to_host']} B to host, {m['dist_staged_bytes_to_device']} B back), "
                     f"{m['dist_collectives_in_xla']} in XLA")
    for reason in m["recompile_reasons"][-3:]:
        lines.append("recompiled: " + reason)
    if m["cpu_fallbacks"]:
        lines.append("CPU fallbacks: " + ", ".join(f"{k} x{v}" for k, v in sorted(m["cpu_fallbacks"].items())))
    else:
        lines.append("CPU fallbacks: none")
    return "\n".join(lines)


def jax_op(name: str, fn=None):
    """Registers a JAX function as the torch custom op `name` ("ns::op"), inlined into tpu programs.

    Returns a callable on torch tensors; @torch_pjrt.jax_op("ns::op") is the decorator form.
    Needs jax (imported only here). See _jax.py.
    """
    from . import _jax

    return _jax.jax_op(name, fn)


def register_lowering(name: str, fn=None, *, platform: str | None = None):
    """Lowers the ATen op `name` ("aten::tanh", "aten::add.Tensor") with fn, a JAX function of the op's
    Tensor arguments (in schema order; None for an absent optional one) returning its results.

    It replaces the op's built-in lowering, or gives one to an op that ran on the CPU. The rule is
    looked up by overload, then base name: "aten::tanh" covers tanh, tanh_ and tanh.out. Each result is
    converted to the dtype PyTorch's meta kernel says; its shape must be the meta kernel's. `platform`
    ("cpu", "cuda" or "tpu": the PJRT plugin's) limits the rule to one plugin, before the rules for every
    platform, as built-in rules are. Used as a decorator without fn:

        @torch_pjrt.register_lowering("aten::tanh", platform="tpu")
        def tanh(x): ...

    Needs jax. Returns fn.
    """
    if platform not in (None, "cpu", "cuda", "tpu"):
        raise ValueError(f"register_lowering: platform must be 'cpu', 'cuda', 'tpu' or None, not {platform!r}")
    if fn is None:
        return functools.partial(register_lowering, name, platform=platform)
    if not callable(fn):
        raise TypeError(f"register_lowering({name!r}): fn must be a function of JAX arrays, not {type(fn).__name__}")
    from . import _jax

    _jax.register_lowering(name, fn, platform or "")
    return fn


def op_traits(name: str, platform: str | None = None):
    """The op's rule (a dict of its traits: lowering, elementwise, complex, cpu_rules, route, ...), or None.

    `name` is "aten::add_.Tensor", "add" or "mode.values"; looked up by overload, then base name, and
    for `platform` (default: the device's) before every platform.
    """
    return _C._op_traits(name, platform)


def platform() -> dict:
    """The PJRT plugin's platform name, version, device kind and C API version."""
    return _C._platform()


def lowered_ops() -> list:
    """Base names of the ops lowered to StableHLO (everything else falls back to the CPU)."""
    return _C._lowered_ops()


class Explanation:
    """What torch_pjrt.explain() found: recompiles and CPU fallbacks since start (or reset_metrics()).

    recompiles: one sentence per recompile (latest 50): which op or fused graph compiled
      again and how it differs from the previous compile (shapes, dtypes; else strides,
      aliasing or arguments).
    cpu_fallbacks: {op name: {"count": calls, "lines": ["file.py:42 in fn", ...]}}, the
      user lines that ran the op on the CPU (up to 10 distinct lines per op).
    """

    def __init__(self, recompiles: list, cpu_fallbacks: dict):
        self.recompiles = recompiles
        self.cpu_fallbacks = cpu_fallbacks

    def __str__(self) -> str:
        lines = [f"recompiles: {len(self.recompiles)}"]
        lines += [f"  {reason}" for reason in self.recompiles]
        lines.append(f"CPU fallbacks: {len(self.cpu_fallbacks)} ops")
        for op, info in sorted(self.cpu_fallbacks.items()):
            where = ", ".join(info["lines"]) or "lines unknown (autograd's backward threads)"
            lines.append(f"  {op} x{info['count']}: {where}")
        return "\n".join(lines)

    __repr__ = __str__


def explain() -> Explanation:
    """Why programs compiled again and which ops ran on the CPU, with the user's lines (print it)."""
    m = metrics()
    lines = m["cpu_fallback_lines"]
    fallbacks = {op: {"count": count, "lines": list(lines.get(op, []))} for op, count in m["cpu_fallbacks"].items()}
    return Explanation(list(m["recompile_reasons"]), fallbacks)
