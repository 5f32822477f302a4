"""torch_pjrt.export: a torch.export program as a portable StableHLO artifact, and artifacts run on tpu.

    ep = torch.export.export(model, (x,))
    torch_pjrt.export.save(ep, "model.export")       # a directory
    run = torch_pjrt.export.load("model.export")      # no model code needed
    y = run(x.to("tpu"))
    exp = run.jax_exported()                          # jax.export.Exported: exp.call(*run.jax_weights(), x)

An artifact is a directory (docs/design/export.md):
- manifest.json: format version, versions (torch_pjrt, torch, StableHLO target), the platform it was lowered
  for, the main function's parameters (weights, then the user's inputs) and results with shapes and dtypes,
  and the user's input and output structure (pytree specs);
- module.mlir: the StableHLO module, its public main taking every tensor in its own shape;
- module.mlirbc: the same module as StableHLO's versioned portable artifact (VHLO bytecode; written when jax
  is installed);
- weights.safetensors (weights.npz without safetensors): parameters, buffers and constant tensors by name;
- jax.exported: jax.export's serialization of the module (when jax can serialize: it needs flatbuffers).

save() reads the recorded graph through the extension (_C._export_program).
"""
from __future__ import annotations

import json
import os

import torch

from . import _capture, _jax_interop, _module
from ._run import ModuleFunction

__all__ = ["save", "load", "from_jax", "LoadedProgram", "FORMAT_VERSION"]

FORMAT = "torch_pjrt.export"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
MODULE_TEXT = "module.mlir"
MODULE_BYTECODE = "module.mlirbc"
JAX_EXPORTED = "jax.exported"


# ---- save ----------------------------------------------------------------------------------------------


def _exported_program(program, args, kwargs):
    if isinstance(program, torch.export.ExportedProgram):
        return program
    if args is None:
        raise TypeError("torch_pjrt.export.save: give example args for a module (or an ExportedProgram)")
    module = program if isinstance(program, torch.nn.Module) else _Wrapped(program)
    return torch.export.export(module, tuple(args), kwargs or {})


class _Wrapped(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def _static(value, what):
    for d in value.shape:
        if not isinstance(d, int):
            raise NotImplementedError(f"torch_pjrt.export: {what} has a dynamic size ({d}); torch_pjrt's programs "
                                      "have static shapes: export with example inputs of the sizes to serve")


def _signature(ep, args, kwargs):
    """(per graph input: (name, kind, tensor)), user inputs' values taken from args/kwargs or the program's
    example inputs; outputs' names."""
    from torch.export.graph_signature import InputKind, OutputKind
    from torch.utils import _pytree as pytree

    if args is None and kwargs is None:
        example = getattr(ep, "example_inputs", None)
        if example is None:
            raise TypeError("torch_pjrt.export.save: the ExportedProgram keeps no example inputs: give args")
        args, kwargs = example
    user, in_spec = pytree.tree_flatten((tuple(args or ()), dict(kwargs or {})))
    if in_spec != ep.call_spec.in_spec:
        raise TypeError(f"torch_pjrt.export.save: the inputs' structure {in_spec} is not the program's "
                        f"{ep.call_spec.in_spec}")
    user = iter(user)
    inputs = []
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            value = next(user)
            if not isinstance(value, torch.Tensor):
                raise NotImplementedError(f"torch_pjrt.export: input {name} is a {type(value).__name__}: only "
                                          "tensor inputs are supported (numbers are fixed in the graph)")
            inputs.append((name, "input", value))
        elif spec.kind == InputKind.PARAMETER or (spec.kind == InputKind.BUFFER and spec.persistent is not False):
            inputs.append((spec.target, "parameter" if spec.kind == InputKind.PARAMETER else "buffer",
                           ep.state_dict[spec.target]))
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.BUFFER):
            inputs.append((spec.target, "constant", ep.constants[spec.target]))
        else:
            raise NotImplementedError(f"torch_pjrt.export: input {name} is a {spec.kind.name}, which a StableHLO "
                                      "artifact cannot hold")
    outputs = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind != OutputKind.USER_OUTPUT:
            raise NotImplementedError(f"torch_pjrt.export: the program has a {spec.kind.name} output ({spec.target}):"
                                      " an exported inference program must not mutate its inputs or buffers")
        outputs.append(spec.arg.name)
    for node in ep.graph_module.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            _static(node.meta["val"], f"input {node.name}")
    return inputs, outputs


def save(program, path, args=None, kwargs=None, *, check: bool = True) -> str:
    """Writes `program` (a torch.export.ExportedProgram, or a module or function with example args/kwargs) as
    an artifact directory at `path`; returns the path.

    The program's graph runs once on tpu (weights and inputs copied there) and is recorded as one torch_pjrt
    program at the example inputs' shapes; check=True then runs the written module on the same inputs and
    requires the graph's outputs.
    """
    from .._compile_backend import decompositions
    from torch.utils import _pytree as pytree

    ep = _exported_program(program, args, kwargs)
    ep = ep.run_decompositions(decompositions())
    inputs, output_names = _signature(ep, args, kwargs)
    device = torch.device("tpu", torch.tpu.current_device())
    # A storage of its own per input, whole and contiguous: each is one program parameter.
    on_device = [t.detach().to(device).clone(memory_format=torch.contiguous_format) for _, _, t in inputs]
    program_, outs = _capture.record(ep.graph_module, on_device)
    input_types = [(tuple(t.shape), t.dtype) for t in on_device]
    output_types = [(tuple(o.shape), o.dtype) for o in outs]
    text = _module.assemble(program_, input_types, output_types)
    if check:
        got = ModuleFunction(text, input_types, output_types)(on_device)
        for i, (g, want) in enumerate(zip(got, outs)):
            try:
                torch.testing.assert_close(g.cpu(), want.cpu(), equal_nan=True)
            except AssertionError as e:
                raise RuntimeError(f"torch_pjrt.export: the written module's output {i} differs from the graph's: "
                                   f"{e}") from None
    weights = {name: t.detach().cpu().contiguous() for name, kind, t in inputs if kind != "input"}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {"torch_pjrt": _version(), "torch": torch.__version__},
        "platform": _platform(),
        "parameters": [{"name": name, "kind": kind, "shape": list(t.shape), "dtype": _module.dtype_name(t.dtype)}
                       for name, kind, t in inputs],
        "results": [{"name": name, "shape": list(s), "dtype": _module.dtype_name(d)}
                    for name, (s, d) in zip(output_names, output_types)],
        "in_spec": pytree.treespec_dumps(ep.call_spec.in_spec),
        "out_spec": pytree.treespec_dumps(ep.call_spec.out_spec),
    }
    return _write(path, manifest, text, weights)


def _version() -> str:
    from .._version import __version__

    return __version__


def _platform() -> str:
    import torch_pjrt

    return torch_pjrt.platform()["name"]


def _write(path, manifest, text, weights) -> str:
    """Writes the artifact's files (module, bytecode and JAX serialization where jax can, weights, manifest)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MODULE_TEXT), "w") as f:
        f.write(text)
    manifest = dict(manifest, module=MODULE_TEXT, bytecode=None, stablehlo_target=None, jax_exported=None)
    if _jax_interop.available():
        import jax

        artifact, target = _jax_interop.portable_artifact(text)
        with open(os.path.join(path, MODULE_BYTECODE), "wb") as f:
            f.write(artifact)
        manifest.update(bytecode=MODULE_BYTECODE, stablehlo_target=target)
        manifest["versions"]["jax"] = jax.__version__
        params = [(p["shape"], _module.dtype_of(p["dtype"])) for p in manifest["parameters"]]
        results = [(r["shape"], _module.dtype_of(r["dtype"])) for r in manifest["results"]]
        data = _jax_interop.serialized(_jax_interop.exported(artifact, params, results, _jax_platform(manifest)))
        if data is not None:
            with open(os.path.join(path, JAX_EXPORTED), "wb") as f:
                f.write(data)
            manifest["jax_exported"] = JAX_EXPORTED
    manifest["weights"] = _write_weights(path, weights)
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return path


def _write_weights(path, weights) -> str:
    try:
        from safetensors.torch import save_file
    except ImportError:
        save_file = None
    if save_file is not None:
        save_file({k: v.clone() for k, v in weights.items()}, os.path.join(path, "weights.safetensors"))
        return "weights.safetensors"
    import numpy as np

    arrays = {k: (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).numpy() for k, v in weights.items()}
    np.savez(os.path.join(path, "weights.npz"), **arrays)
    return "weights.npz"


def _read_weights(path, manifest) -> dict:
    name = manifest["weights"]
    file = os.path.join(path, name)
    if name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(file)
    import numpy as np

    dtypes = {p["name"]: _module.dtype_of(p["dtype"]) for p in manifest["parameters"]}
    with np.load(file) as data:
        out = {}
        for k in data.files:
            t = torch.from_numpy(data[k].copy())
            out[k] = t.view(torch.bfloat16) if dtypes.get(k) == torch.bfloat16 else t
        return out


def _jax_platform(manifest) -> str:
    return {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "tpu": "tpu"}.get(manifest.get("platform"), "cpu")


# ---- load ----------------------------------------------------------------------------------------------


class LoadedProgram:
    """An artifact's program: call it with the user's inputs (the structure they were exported with); it
    runs on tpu as one op (its module) and returns tpu tensors in the exported output structure."""

    def __init__(self, manifest, text, weights, bytecode=None):
        from torch.utils import _pytree as pytree

        if manifest.get("format") != FORMAT or manifest.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"torch_pjrt.export: not an artifact this version reads (format "
                             f"{manifest.get('format')!r} version {manifest.get('format_version')})")
        self.manifest = manifest
        self.module_text = text
        self.bytecode = bytecode
        self.weights = weights
        self.parameters = manifest["parameters"]
        self.in_spec = pytree.treespec_loads(manifest["in_spec"]) if manifest.get("in_spec") else None
        self.out_spec = pytree.treespec_loads(manifest["out_spec"]) if manifest.get("out_spec") else None
        types = lambda entries: [(tuple(e["shape"]), _module.dtype_of(e["dtype"])) for e in entries]
        self.input_types = types(self.parameters)
        self.output_types = types(manifest["results"])
        missing = [p["name"] for p in self.parameters if p["kind"] != "input" and p["name"] not in weights]
        if missing:
            raise ValueError(f"torch_pjrt.export: the weights lack {missing}")
        self.function = ModuleFunction(text, self.input_types, self.output_types)
        self._device_weights = {}

    def _weights_on(self, device):
        key = str(device)
        if key not in self._device_weights:
            self._device_weights[key] = {p["name"]: self.weights[p["name"]].to(device)
                                         for p in self.parameters if p["kind"] != "input"}
        return self._device_weights[key]

    def flat_inputs(self, args, kwargs) -> list:
        from torch.utils import _pytree as pytree

        flat, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if self.in_spec is not None and spec != self.in_spec:
            raise TypeError(f"torch_pjrt.export: inputs of structure {spec}, the program was exported with "
                            f"{self.in_spec}")
        return flat

    def __call__(self, *args, **kwargs):
        from torch.utils import _pytree as pytree

        flat = self.flat_inputs(args, kwargs)
        user = iter(flat)
        first = next((t for t in flat if isinstance(t, torch.Tensor)), None)
        device = first.device if first is not None and first.device.type == "tpu" else \
            torch.device("tpu", torch.tpu.current_device())
        weights = self._weights_on(device)
        tensors = []
        for p in self.parameters:
            t = next(user) if p["kind"] == "input" else weights[p["name"]]
            tensors.append(t.to(device) if isinstance(t, torch.Tensor) else t)
        outs = self.function(tensors)
        return pytree.tree_unflatten(outs, self.out_spec) if self.out_spec is not None else tuple(outs)

    # ---- JAX ----

    def jax_exported(self):
        """The module as a jax.export.Exported: exp.call(*self.jax_weights(), *inputs) runs it with JAX, whose
        arguments are every parameter (weights and inputs) in manifest order."""
        artifact = self.bytecode
        if artifact is None:
            artifact, _ = _jax_interop.portable_artifact(self.module_text)
        return _jax_interop.exported(artifact, self.input_types, self.output_types, _jax_platform(self.manifest))

    def jax_weights(self) -> list:
        """The weights as NumPy arrays, in the order of main's parameters (JAX's arguments before the inputs)."""
        return [_jax_interop.to_numpy(self.weights[p["name"]]) for p in self.parameters if p["kind"] != "input"]


def load(path) -> LoadedProgram:
    """The artifact at `path` as a callable running on tpu (module.mlir, or the bytecode with jax)."""
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    bytecode = None
    if manifest.get("bytecode") and os.path.exists(os.path.join(path, manifest["bytecode"])):
        with open(os.path.join(path, manifest["bytecode"]), "rb") as f:
            bytecode = f.read()
    text_file = os.path.join(path, manifest.get("module") or MODULE_TEXT)
    if os.path.exists(text_file):
        with open(text_file) as f:
            text = f.read()
    elif bytecode is not None:
        text = _jax_interop.module_text(bytecode)
    else:
        raise FileNotFoundError(f"torch_pjrt.export: {path} holds neither {MODULE_TEXT} nor its bytecode")
    return LoadedProgram(manifest, text, _read_weights(path, manifest), bytecode)


def from_jax(exported) -> "JaxProgram":
    """A jax.export.Exported (from jax.export.export, or jax.export.deserialize of its bytes) as a function of
    tpu tensors: its StableHLO runs on tpu through torch_pjrt, as one op. One platform, no effects."""
    if len(exported.platforms) != 1:
        raise NotImplementedError(f"torch_pjrt.export.from_jax: a module lowered for {len(exported.platforms)} "
                                  "platforms takes a platform index argument; export for one platform")
    if exported.ordered_effects or exported.unordered_effects:
        raise NotImplementedError("torch_pjrt.export.from_jax: a module with effects takes tokens")
    return JaxProgram(exported)


class JaxProgram:
    """from_jax's result: call it with tensors shaped as the Exported's in_avals (flat); returns a list."""

    def __init__(self, exported):
        from .._jax import _jax_dtype_to_torch

        self.exported = exported
        self.kept = list(exported.module_kept_var_idx)  # JAX drops unused arguments from main
        avals = [(tuple(a.shape), _jax_dtype_to_torch(a.dtype)) for a in exported.in_avals]
        self.input_types = avals
        self.output_types = [(tuple(a.shape), _jax_dtype_to_torch(a.dtype)) for a in exported.out_avals]
        text = _jax_interop.module_text(exported.mlir_module_serialized)
        self.function = ModuleFunction(text, [avals[i] for i in self.kept], self.output_types)

    def __call__(self, *tensors):
        if len(tensors) != len(self.input_types):
            raise TypeError(f"torch_pjrt.export: the JAX function takes {len(self.input_types)} arrays, got "
                            f"{len(tensors)}")
        device = next((t.device for t in tensors if t.device.type == "tpu"),
                      torch.device("tpu", torch.tpu.current_device()))
        return self.function([tensors[i].to(device) for i in self.kept])
