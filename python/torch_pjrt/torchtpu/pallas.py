"""torch.tpu.pallas: JAX and Pallas functions as torch ops, with TorchTPU's arguments.

`jax_op("ns::name", fn)` takes TorchTPU's keyword arguments and runs on torch_pjrt's jax_op (the JAX function
is lowered to StableHLO and inlined into the tpu program; on CPU tensors it runs with jax):

- tensors are traced; every other argument (ints, floats, strings, dtypes, enums, None) is a compile-time
  constant, as TorchTPU infers from the annotations: each distinct set of constants is its own torch op,
  `ns::name` for calls with tensors only, `ns::name__<hash>` otherwise (registered at the first such call);
- the result keeps the function's structure (a tensor, a tuple, a list, a dict of tensors);
- `donate_argnums`: a donated tensor's storage is reused for a result of its shape and dtype (the first one
  not yet taken): the result is written into it in the same program, whose buffer the program donates (no
  new buffer, no copy), and the call returns the donated tensor in that result's place. TorchTPU leaves a
  donated tensor invalid, so code written for it never reads it again; here it holds the result;
- under torch.compile the call is one opaque call to Dynamo (`torch._dynamo.nonstrict_trace`: Dynamo must not
  trace JAX), which AOTAutograd traces to the torch_pjrt ops it runs;
- `mesh`, `input_partition_specs` and `output_partition_specs` raise NotImplementedError: a jax_op runs on
  one device.

`custom_jax_kernel` is TorchTPU's deprecated older form (it warns once).
"""
from __future__ import annotations

import enum
import hashlib
import inspect
import itertools
import re
import threading
import warnings

import torch

__all__ = ["jax_op", "custom_jax_kernel"]


def _check_name(name: str) -> None:
    if not isinstance(name, str) or "::" not in name:
        raise ValueError(f"Op name {name} does not contain a namespace.")
    if len(name.split("::")) != 2:
        raise ValueError(f"Op name {name} must have exactly one '::' separator.")


def _refuse_sharding(mesh, input_partition_specs, output_partition_specs) -> None:
    if mesh is not None or input_partition_specs is not None or output_partition_specs is not None:
        raise NotImplementedError("torch_pjrt's jax_op runs a JAX function on one device: mesh, "
                                  "input_partition_specs and output_partition_specs are not supported")


def _static_value(value):
    """A hashable stand-in for a constant argument, as JAX sees it (torch dtypes become JAX dtypes)."""
    if isinstance(value, torch.dtype):
        from .._jax import _torch_dtype_to_jax

        return _torch_dtype_to_jax(value)
    if isinstance(value, list):
        return tuple(_static_value(v) for v in value)
    if isinstance(value, tuple):
        return type(value)(_static_value(v) for v in value) if not hasattr(value, "_fields") else value
    return value


def _key_part(value):
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"torch.tpu.pallas: a constant (non-tensor) argument must be hashable, got {value!r}") from None
    return (type(value).__qualname__, value.name if isinstance(value, enum.Enum) else repr(value))


class _Template:
    """How one call's arguments split into traced tensors and constants."""

    def __init__(self):
        self.tensors = []  # torch tensors in order
        self.key = []  # hashable description: constants' values, tensor positions and list lengths

    def tensor(self, t):
        self.tensors.append(t)
        return ("t", len(self.tensors) - 1)

    def leaf(self, value, static: bool, where: str, strict: bool):
        if strict and static and isinstance(value, torch.Tensor):
            raise ValueError(f"{where} is marked as static but is a torch.Tensor. Tensors cannot be static "
                             "arguments.")
        if not static and isinstance(value, torch.Tensor):
            spec = self.tensor(value)
            self.key.append(("t",))
            return spec
        if (not static and isinstance(value, (list, tuple)) and value
                and all(isinstance(v, torch.Tensor) for v in value)):
            specs = [self.tensor(v) for v in value]
            self.key.append(("l", type(value).__name__, len(value)))
            return ("l", type(value), specs)
        if strict and not static and value is not None:
            raise TypeError(f"custom kernels only support torch.Tensor and None inputs, but {where} was of type "
                            f"{type(value)}. Use static_argnums or functools.partial for non-tensor args.")
        value = _static_value(value)
        self.key.append(("s", _key_part(value)))
        return ("s", value)


def _fill(spec, xs):
    kind = spec[0]
    if kind == "t":
        return xs[spec[1]]
    if kind == "l":
        return spec[1](xs[s[1]] for s in spec[2])
    return spec[1]


_kernels: dict = {}  # number -> _Kernel, for calls under torch.compile (Dynamo passes the number)
_kernel_numbers = itertools.count()
_compiled_call = None  # the call under torch.compile: made with the first kernel (importing Dynamo takes seconds)


def _call_kernel(number, args, kwargs):
    return _kernels[number]._call(args, kwargs)


def _make_compiled_call() -> None:
    global _compiled_call
    if _compiled_call is None:
        import torch._dynamo

        _compiled_call = torch._dynamo.nonstrict_trace(_call_kernel)


class _Kernel:
    """A JAX function called with torch tensors: one torch_pjrt jax_op per set of constant arguments."""

    def __init__(self, op_name, fn, *, static_argnums=(), static_argnames=(), donate_argnums=None,
                 input_output_aliases=None, strict=False):
        from .. import _jax

        _jax._jax()  # jax must be importable now
        self.op_name = op_name
        self.fn = fn
        self.strict = strict
        self.static_argnums = {int(i) for i in (static_argnums or ())}
        self.static_argnames = set(static_argnames or ())
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        self.donate_argnums = tuple(donate_argnums) if donate_argnums is not None else ()
        self.input_output_aliases = dict(input_output_aliases or {})
        positional = None
        if self.signature is not None:
            params = list(self.signature.parameters.values())
            if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
                positional = sum(p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                 for p in params)
        for i in itertools.chain(self.donate_argnums, self.input_output_aliases):
            if not isinstance(i, int) or i < 0 or (positional is not None and i >= positional):
                raise ValueError(f"{op_name}: argument index {i!r} (donate_argnums / input_output_aliases) is not "
                                 f"a positional parameter of the function")
        self._lock = threading.Lock()
        self._id = next(_kernel_numbers)
        _kernels[self._id] = self
        _make_compiled_call()
        self._ops = {}  # template key -> (torch_pjrt JaxFunction, argument specs)
        self._trees = {}  # (template key, tensor types) -> result tree structure
        self._plain_name_taken = False

    def _template(self, args, kwargs):
        template = _Template()
        positions = []  # (position or None, name, spec)
        if self.signature is None:
            for i, a in enumerate(args):
                positions.append((i, None, template.leaf(a, i in self.static_argnums, f"input {i}", self.strict)))
            for k, v in kwargs.items():
                positions.append((None, k, template.leaf(v, k in self.static_argnames, f"input {k!r}", self.strict)))
            return template, positions
        bound = self.signature.bind(*args, **kwargs)
        index = 0
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                for v in value:
                    positions.append((index, None, template.leaf(v, index in self.static_argnums, f"input {index}",
                                                                 self.strict)))
                    index += 1
            elif kind is inspect.Parameter.VAR_KEYWORD:
                for k, v in value.items():
                    positions.append((None, k, template.leaf(v, k in self.static_argnames, f"input {k!r}",
                                                             self.strict)))
            elif kind is inspect.Parameter.KEYWORD_ONLY:
                positions.append((None, name, template.leaf(value, name in self.static_argnames, f"input {name!r}",
                                                            self.strict)))
            else:
                static = index in self.static_argnums or name in self.static_argnames
                positions.append((index, None, template.leaf(value, static, f"input {index}", self.strict)))
                index += 1
        return template, positions

    def _call_with(self, positions, xs):
        args = [_fill(spec, xs) for i, name, spec in positions if name is None]
        kwargs = {name: _fill(spec, xs) for i, name, spec in positions if name is not None}
        return self.fn(*args, **kwargs)

    def _op(self, key, positions):
        with self._lock:
            found = self._ops.get(key)
            if found is not None:
                return found[0]
            from .._jax import JaxFunction

            plain = all(part == ("t",) for part in key[0])
            if plain and not self._plain_name_taken:
                name = self.op_name
                self._plain_name_taken = True
            else:
                name = f"{self.op_name}__{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"
            name = re.sub(r"[^\w:]", "_", name)
            op = JaxFunction(name, lambda *xs: self._call_with(positions, xs))
            self._ops[key] = (op, positions)
            return op

    def _tree(self, key, positions, tensors):
        import jax

        from .._jax import _avals

        types = tuple((tuple(t.shape), t.dtype) for t in tensors)
        tree = self._trees.get((key, types))
        if tree is None:
            out = jax.eval_shape(lambda *xs: self._call_with(positions, xs), *_avals(tensors))
            tree = self._trees[(key, types)] = jax.tree_util.tree_structure(out)
        return tree

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # Dynamo must not trace JAX (the op's registration, its result structure): it puts this call in
            # the graph as one opaque call, which AOTAutograd traces to the torch_pjrt op(s) it runs.
            return _compiled_call(self._id, args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args, kwargs):
        template, positions = self._template(args, kwargs)
        if not template.tensors:
            raise ValueError(f"{self.op_name}: a jax op needs at least one tensor argument")
        key = (tuple(template.key), tuple((i, name) for i, name, _ in positions))
        op = self._op(key, positions)
        tree = self._tree(key, positions, template.tensors)
        donated = self._donated(positions, template.tensors)
        with _one_program(donated):
            out = op(*template.tensors)
            leaves = [out] if isinstance(out, torch.Tensor) else list(out)
            _donate(donated, leaves)
        if self.input_output_aliases:
            for i, name, spec in positions:
                if name is None and i in self.input_output_aliases and spec[0] == "t":
                    template.tensors[spec[1]].copy_(leaves[self.input_output_aliases[i]])
        return tree.unflatten(leaves)

    def _donated(self, positions, tensors):
        """The tensors of this call's donated positional arguments (each once), in argument order."""
        if not self.donate_argnums:
            return []
        donated = []
        for i, name, spec in positions:
            if name is None and i in self.donate_argnums and spec[0] == "t":
                t = tensors[spec[1]]
                if not any(t is d for d in donated):
                    donated.append(t)
        return donated

    def __repr__(self) -> str:
        return f"<torch.tpu.pallas jax op {self.op_name}>"


def _donate(donated, leaves) -> None:
    """Writes results into the donated tensors' storage and returns those tensors in their place.

    Each donated tensor takes the first result not yet taken with its shape and dtype (as JAX reuses a donated
    buffer for an output of its type); a donated tensor no result fits keeps its value. A tensor autograd
    records (requires_grad, grad mode on) is not donated: its old value may be needed for the gradient.
    """
    taken = set()
    for t in donated:
        if torch.is_grad_enabled() and t.requires_grad:
            continue
        for k, leaf in enumerate(leaves):
            if k in taken or not isinstance(leaf, torch.Tensor) or leaf.shape != t.shape or leaf.dtype != t.dtype:
                continue
            if torch.is_grad_enabled() and leaf.requires_grad:
                break
            t.copy_(leaf)
            leaves[k] = t
            taken.add(k)
            break


def _one_program(donated):
    """A scope in which a donating call and its copies are one program, in every mode.

    In fused and lazy mode the copy joins the jax_call's graph, whose program then donates the tensor's buffer
    to the result (a storage the graph reads and overwrites, held by nothing else). Strict and debug mode run
    each op as its own program, so a donating call runs in compiled mode's one-program scope instead.
    """
    import contextlib

    if not donated or not any(t.device.type == "tpu" for t in donated) or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    from .. import _C

    if _C._get_mode() not in ("strict", "debug"):
        return contextlib.nullcontext()
    from .._compile_backend import _OneProgram

    return _OneProgram()


def jax_op(name, fn=None, /, *, donate_argnums=None, mesh=None, input_partition_specs=None,
           output_partition_specs=None):
    """Registers the JAX function `fn` as the torch op `name` ("ns::op"); decorator form without fn.

    Returns a callable on torch tensors (and constant arguments) that returns torch tensors in fn's result
    structure. See the module's docstring for donation and sharding.
    """
    _check_name(name)
    _refuse_sharding(mesh, input_partition_specs, output_partition_specs)
    if fn is None:
        return lambda f: jax_op(name, f, donate_argnums=donate_argnums)
    return _Kernel(name, fn, donate_argnums=donate_argnums)


_warned_custom_jax_kernel = False
_kernel_ids = itertools.count()


def custom_jax_kernel(jax_fn=None, name=None, static_argnums=(), donate_argnums=None, input_output_aliases=None,
                      mesh=None, input_partition_specs=None, output_partition_specs=None, *, static_argnames=(),
                      warn_deprecated=True):
    """Deprecated in TorchTPU (use jax_op): jax_fn as a callable on torch tensors.

    Constant arguments are the ones named by static_argnums / static_argnames (any other non-tensor argument
    but None is a TypeError). input_output_aliases {input index: output index} copies that output into the
    input tensor after the call.
    """
    global _warned_custom_jax_kernel
    if warn_deprecated and not _warned_custom_jax_kernel:
        _warned_custom_jax_kernel = True
        warnings.warn("torch.tpu.pallas.custom_jax_kernel is deprecated: use torch.tpu.pallas.jax_op",
                      FutureWarning, stacklevel=2)
    _refuse_sharding(mesh, input_partition_specs, output_partition_specs)
    if input_output_aliases is not None and donate_argnums is not None and \
            set(input_output_aliases) != set(donate_argnums):
        raise ValueError("donate_argnums must be None or the same as the keys of input_output_aliases.")

    def decorator(fn):
        kernel_name = name or getattr(fn, "__name__", None) or "kernel"
        op_name = f"torch_tpu_compat::{re.sub(r'[^0-9A-Za-z_]', '_', kernel_name)}_{next(_kernel_ids)}"
        return _Kernel(op_name, fn, static_argnums=static_argnums, static_argnames=static_argnames,
                       donate_argnums=donate_argnums, input_output_aliases=input_output_aliases, strict=True)

    if jax_fn is None:
        return decorator
    return decorator(jax_fn)
