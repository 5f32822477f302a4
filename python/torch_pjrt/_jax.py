"""JAX kernels inside PyTorch models: torch_pjrt.jax_op("ns::name", fn).

    def rms_norm(x, w):                       # jax.numpy
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w
    rms = torch_pjrt.jax_op("mylib::rms_norm", rms_norm)
    y = rms(x, w)                             # torch tensors in, torch tensors out

The op is a torch.library custom op `ns::name(Tensor[] args) -> Tensor[]`:
- its fake (meta) implementation comes from jax.eval_shape;
- on tpu it lowers fn with jax.jit(fn).lower(...) for the arguments' shapes and
  dtypes, takes the StableHLO module in generic MLIR form, renames its symbols
  to a unique private prefix and registers the text with the extension; the op
  then runs as torch_pjrt::jax_call(args, key), one op that the lowering
  inlines as a func.call, so it fuses with the ops around it in eager, fused
  and compiled (torch.compile(backend="tpu")) mode alike;
- on the CPU it runs fn with jax (jax's CPU backend);
- autograd goes through jax.vjp, as another jax op "ns::name_jax_vjp".

jax is optional: importing torch_pjrt never imports it; jax_op does.
"""
from __future__ import annotations

import hashlib
import re
import threading

import torch

from . import _C

_lock = threading.Lock()
_modules: dict = {}  # key -> _Lowered (for jax_call's meta and CPU kernels)
_library = None


class _Lowered:
    def __init__(self, fn, out_avals):
        self.fn = fn
        self.out_avals = out_avals  # [(shape, torch dtype)]


def _jax():
    try:
        import jax
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("torch_pjrt.jax_op needs jax: pip install jax") from e
    return jax


def _torch_dtype_to_jax(dtype):
    import jax.numpy as jnp

    table = {torch.float32: jnp.float32, torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16,
             torch.float64: jnp.float64, torch.int8: jnp.int8, torch.uint8: jnp.uint8, torch.int16: jnp.int16,
             torch.int32: jnp.int32, torch.int64: jnp.int64, torch.bool: jnp.bool_}
    if dtype not in table:
        raise TypeError(f"torch_pjrt.jax_op: dtype {dtype} has no JAX equivalent")
    return table[dtype]


def _jax_dtype_to_torch(dtype):
    import numpy as np

    name = np.dtype(dtype).name
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
             "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
    if name not in table:
        raise TypeError(f"torch_pjrt.jax_op: JAX result dtype {name} has no torch equivalent")
    return table[name]


def _avals(args):
    jax = _jax()
    return [jax.ShapeDtypeStruct(tuple(a.shape), _torch_dtype_to_jax(a.dtype)) for a in args]


def _out_avals(fn, args):
    """[(shape, torch dtype)] of fn's results for these arguments (jax.eval_shape)."""
    jax = _jax()
    out = jax.eval_shape(fn, *_avals(args))
    leaves = jax.tree_util.tree_leaves(out)
    if not leaves:
        raise ValueError("torch_pjrt.jax_op: the JAX function returns no arrays")
    return [(tuple(o.shape), _jax_dtype_to_torch(o.dtype)) for o in leaves]


def _flat_fn(fn):
    """fn returning a flat tuple of its result leaves (jax_call returns a list)."""
    jax = _jax()

    def flat(*xs):
        return tuple(jax.tree_util.tree_leaves(fn(*xs)))

    return flat


# A function definition's symbol, in the pretty (`func.func private @f`) or the generic (`sym_name = "f"`) form.
_DEFINED = re.compile(r'func\.func\s+(?:(?:public|private|nested)\s+)?@([\w$.-]+)|sym_name\s*=\s*"([\w$.-]+)"')


def _private_functions(text: str, prefix: str, owner: str):
    """A module's functions with every symbol prefixed and made private, as callees inside torch_pjrt's
    programs (which have a main of their own): (main's new symbol, the definitions). Generic or pretty form."""
    symbols = {a or b for a, b in _DEFINED.findall(text)}
    if "main" not in symbols:
        raise ValueError(f"{owner}: the module has no main function")
    names = "|".join(re.escape(s) for s in sorted(symbols, key=len, reverse=True))
    text = re.sub(r"@(" + names + r")(?![\w$.-])", lambda m: f"@{prefix}{m.group(1)}", text)
    text = re.sub(r'sym_name\s*=\s*"(' + names + r')"', lambda m: f'sym_name = "{prefix}{m.group(1)}"', text)
    text = re.sub(r"func\.func\s+public\s+@", "func.func private @", text)
    text = text.replace('sym_visibility = "public"', 'sym_visibility = "private"')
    # A public function with no visibility keyword is printed without one: make every definition private.
    text = re.sub(r"func\.func\s+@", "func.func private @", text)
    return prefix + "main", text


def _generic_functions(lowered, prefix):
    """The lowered JAX module's func.func ops as generic MLIR text, every symbol prefixed; main is private."""
    module = lowered.compiler_ir("stablehlo")
    text = "\n".join(op.get_asm(print_generic_op_form=True) for op in module.body.operations)
    return _private_functions(text, prefix, "torch_pjrt.jax_op: the lowered JAX module")


_CUSTOM_CALL = re.compile(r'call_target_name = "([^"]+)"')


def _unsupported_reason(name, text):
    """Why the device cannot run this lowered function ("" if it can).

    JAX lowers some functions to custom calls into its own runtime (LAPACK
    solvers, Python callbacks); the CPU PJRT plugin registers none of them, so
    such a function runs with jax on the CPU (in every mode: inside a fused
    graph it would fail the whole program's compile instead). On GPU and TPU
    the custom calls Pallas emits (Triton, Mosaic) are the kernel itself.
    """
    targets = sorted(set(_CUSTOM_CALL.findall(text)))
    if not targets:
        return ""
    from . import platform

    if platform()["name"] != "cpu":
        return ""
    return f"{name} calls custom call(s) {', '.join(targets)}, which the cpu PJRT plugin does not provide"


def _register_lowering(fn, args, name="jax_op"):
    """Lowers fn for these argument types (once) and registers it; returns its key."""
    jax = _jax()
    avals = _avals(args)
    # keep_unused: jit drops unused parameters from the module (the primals of a linear function's vjp),
    # but jax_call passes every argument.
    lowered = jax.jit(fn, keep_unused=True).lower(*avals)
    text_for_hash = lowered.as_text()
    digest = hashlib.sha1(text_for_hash.encode()).hexdigest()[:16]
    key = f"jax_{digest}"
    with _lock:
        if key in _modules:
            return key
    in_types = jax.tree_util.tree_leaves(lowered.in_avals)
    for i, (a, aval) in enumerate(zip(args, in_types)):
        if tuple(aval.shape) != tuple(a.shape) or _jax_dtype_to_torch(aval.dtype) != a.dtype:
            raise TypeError(f"torch_pjrt.jax_op: argument {i} is {a.dtype}{list(a.shape)} but JAX lowers it as "
                            f"{aval.dtype}{list(aval.shape)} (64-bit types need jax_enable_x64)")
    out_avals = [(tuple(o.shape), _jax_dtype_to_torch(o.dtype)) for o in jax.tree_util.tree_leaves(lowered.out_info)]
    symbol, text = _generic_functions(lowered, key + "_")
    _C._register_external_function(key, symbol, text, _unsupported_reason(name, text))
    with _lock:
        _modules[key] = _Lowered(fn, out_avals)
    return key


def _define_jax_call() -> None:
    """torch_pjrt::jax_call(Tensor[] args, str module) -> Tensor[]: the op the lowering inlines."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("torch_pjrt", "FRAGMENT")
    _library.define("jax_call(Tensor[] args, str module) -> Tensor[]")

    def meta(args, module):
        lowered = _modules[module]
        return [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in lowered.out_avals]

    def cpu(args, module):
        return _run_on_cpu(_modules[module].fn, args)

    _library.impl("jax_call", meta, "Meta")
    _library.impl("jax_call", cpu, "CPU")


def _to_numpy(t):
    """A CPU tensor as a NumPy array; bfloat16 (which NumPy lacks) as JAX's ml_dtypes bfloat16."""
    import jax.numpy as jnp

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


def _from_numpy(a):
    import numpy as np

    a = np.array(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _run_on_cpu(fn, args):
    jax = _jax()
    cpu_device = jax.devices("cpu")[0]
    xs = [jax.device_put(_to_numpy(a), cpu_device) for a in args]
    outs = fn(*xs)
    return [_from_numpy(o) for o in outs]


def _float(t) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


class _JaxOp:
    """A torch custom op computing flat_fn(*groups) in JAX (one tensor list per group).

    `jax_fn(groups)` returns the JAX function of all the groups' tensors
    concatenated, for these groups' dtypes and lengths.
    """

    def __init__(self, name, schema, jax_fn):
        _define_jax_call()
        self.name = name
        self.jax_fn = jax_fn
        self._fns = {}  # (group lengths, float mask) -> JAX function
        self._keys = {}  # argument shapes and dtypes -> registered lowering (lowering takes milliseconds)
        self.op = torch.library.custom_op(name, self._cpu, mutates_args=(), device_types="cpu", schema=schema)
        self.op.register_kernel("tpu")(self._tpu)
        self.op.register_fake(self._fake)

    def _fn(self, groups):
        key = (tuple(len(g) for g in groups), tuple(_float(t) for g in groups for t in g))
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self.jax_fn(groups)
        return fn

    def _cpu(self, *groups):
        return _run_on_cpu(self._fn(groups), [t for g in groups for t in g])

    def _tpu(self, *groups):
        args = [t for g in groups for t in g]
        types = (tuple(len(g) for g in groups), tuple((tuple(t.shape), t.dtype) for t in args))
        key = self._keys.get(types)
        if key is None:
            key = self._keys[types] = _register_lowering(self._fn(groups), args, self.name)
        return list(torch.ops.torch_pjrt.jax_call(args, key))

    def _fake(self, *groups):
        args = [t for g in groups for t in g]
        if not args:
            raise ValueError(f"{self.name}: a jax_op needs at least one tensor argument")
        return [torch.empty(shape, dtype=dtype, device=args[0].device)
                for shape, dtype in _out_avals(self._fn(groups), args)]


class JaxFunction:
    """What jax_op returns: call it with torch tensors; returns a tensor or a tuple of them."""

    def __init__(self, name, fn):
        jax = _jax()
        flat = _flat_fn(fn)
        self.forward = _JaxOp(name, "(Tensor[] args) -> Tensor[]", lambda groups: flat)
        self.backward = _JaxOp(name + "_jax_vjp", "(Tensor[] primals, Tensor[] cotangents) -> Tensor[]",
                               lambda groups: _vjp_of(jax, flat, groups[0], name))
        self.forward.op.register_autograd(self._backward, setup_context=self._setup_context)

    @staticmethod
    def _setup_context(ctx, inputs, output):
        (args,) = inputs
        ctx.save_for_backward(*args)
        ctx.out_meta = [(o.shape, o.dtype) for o in output]

    def _backward(self, ctx, grads):
        args = list(ctx.saved_tensors)
        cotangents = [g if g is not None else torch.zeros(shape, dtype=dtype, device=args[0].device)
                      for g, (shape, dtype) in zip(grads, ctx.out_meta)]
        float_grads = iter(self.backward.op(args, cotangents))
        return ([next(float_grads) if _float(a) else None for a in args],)

    def __call__(self, *tensors):
        out = self.forward.op(list(tensors))
        return out[0] if len(out) == 1 else tuple(out)


def _vjp_of(jax, flat, primals, name):
    """JAX function (*primals, *cotangents) -> gradients of the floating primals (jax.vjp)."""
    n = len(primals)
    floating = [_float(p) for p in primals]

    def grads(*xs):
        values, cotangents = xs[:n], xs[n:]

        def of_floats(*fs):
            it = iter(fs)
            return flat(*[next(it) if f else v for v, f in zip(values, floating)])

        try:
            _, pullback = jax.vjp(of_floats, *[v for v, f in zip(values, floating) if f])
            return tuple(pullback(tuple(cotangents)))
        except Exception as e:  # JAX's own message rarely names the cause (a Pallas kernel: an AssertionError)
            raise TypeError(f"{name}: JAX cannot differentiate this function ({type(e).__name__}: {e}); "
                            "Pallas kernels have no reverse-mode autodiff: give the function a backward "
                            "with jax.custom_vjp") from e

    return grads


def jax_op(name: str, fn=None):
    """Registers fn (a JAX function of arrays) as the torch custom op `name` ("ns::op").

    Returns a callable taking and returning torch tensors. Decorator form:
    @torch_pjrt.jax_op("ns::op").
    """
    if fn is None:
        return lambda f: jax_op(name, f)
    return JaxFunction(name, fn)


def register_lowering(name: str, fn, platform: str = "") -> None:
    """torch_pjrt.register_lowering: fn (JAX) becomes the lowering of the ATen op `name`.

    The C++ rule calls `lower` when it plans the op for new argument types: it lowers fn for them with
    the jax_op machinery (_register_lowering) and returns the registered function's key.
    """
    _jax()  # jax must be there now, not at the op's first call
    import jax.numpy as jnp

    def lower(args, outs):
        present = [i for i, a in enumerate(args) if a is not None]
        expected = [(tuple(shape), dtype) for shape, dtype in outs]

        def call(*xs):
            full = [None] * len(args)
            for i, x in zip(present, xs):
                full[i] = x
            results = _jax().tree_util.tree_leaves(fn(*full))
            if len(results) != len(expected):
                raise ValueError(f"register_lowering({name!r}): the JAX function returns {len(results)} arrays, "
                                 f"the op {len(expected)}")
            converted = []
            for k, (r, (shape, dtype)) in enumerate(zip(results, expected)):
                if tuple(r.shape) != shape:
                    raise ValueError(f"register_lowering({name!r}): result {k} has shape {list(r.shape)}, "
                                     f"the op's is {list(shape)}")
                converted.append(jnp.asarray(r).astype(_torch_dtype_to_jax(dtype)))
            return tuple(converted)

        stand_ins = [torch.empty(args[i][0], dtype=args[i][1], device="meta") for i in present]
        return _register_lowering(call, stand_ins, name)

    _define_jax_call()  # the jax_call op's meta kernel knows the registered functions
    _C._register_lowering(name, lower, platform)
