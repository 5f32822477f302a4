"""torch_pjrt.export: StableHLO artifacts from torch.export programs, loaded and run on tpu without the model's
code, and by JAX (docs/design/export.md).

References: PyTorch on the CPU (the model's own forward) for every output; JAX on its CPU backend for
from_jax.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import torch_pjrt
from torch_pjrt import _C
from torch_pjrt import export as tx
from torch_pjrt.export import _capture, _module

pytestmark = pytest.mark.modes_inside  # the module runs as one op in every mode: once per `make test`

DEVICE = "tpu"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


class Head(nn.Module):
    """Sizes chosen so that every weight, input and output has an element count of its own."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.register_buffer("shift", torch.linspace(-1, 1, 7))

    def forward(self, x, *, bias):
        y = torch.tanh(self.lin(x))
        return {"y": y, "total": y.sum(-1) + bias, "shift": self.shift.clone()}


def _expected(model, x, bias):
    with torch.no_grad():
        return model(x, bias=bias)


def test_save_then_load_runs_without_the_model_and_equals_cpu(tmp_path):
    torch.manual_seed(0)
    model = Head().eval()
    x, bias = torch.randn(3, 4), torch.randn(3)
    ep = torch.export.export(model, (x,), {"bias": bias})
    path = tx.save(ep, str(tmp_path / "head.export"))
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["format"] == "torch_pjrt.export" and manifest["format_version"] == tx.FORMAT_VERSION
    assert manifest["versions"]["torch_pjrt"] == torch_pjrt.__version__
    assert [(p["name"], p["kind"], p["shape"]) for p in manifest["parameters"]] == [
        ("lin.weight", "parameter", [5, 4]), ("lin.bias", "parameter", [5]), ("shift", "buffer", [7]),
        ("x", "input", [3, 4]), ("bias", "input", [3])]
    assert [(r["shape"], r["dtype"]) for r in manifest["results"]] == [([3, 5], "float32"), ([3], "float32"),
                                                                      ([7], "float32")]
    text = open(os.path.join(path, "module.mlir")).read()
    assert "func.func public @main(%arg0: tensor<5x4xf32>" in text and "loc(" not in text

    expected = _expected(model, x, bias)
    # A process without the model's code: only the artifact and torch_pjrt.
    code = ("import sys, torch, torch_pjrt.export as tx\n"
            "run = tx.load(sys.argv[1])\n"
            "x, bias = torch.load(sys.argv[2])\n"
            "out = run(x.to('tpu'), bias=bias.to('tpu'))\n"
            "torch.save({k: v.cpu() for k, v in out.items()}, sys.argv[3])\n")
    torch.save((x, bias), tmp_path / "inputs.pt")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run([sys.executable, "-c", code, path, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert set(got) == set(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-5, rtol=1e-5)

    # In this process too, and from the bytecode alone (module.mlir removed) where jax can read it.
    run = tx.load(path)
    out = run(x.to(DEVICE), bias=bias.to(DEVICE))
    assert out["y"].device.type == DEVICE
    torch.testing.assert_close(out["total"].cpu(), expected["total"], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match=r"exported for torch.float32\[3, 4\]"):
        run(torch.randn(2, 4, device=DEVICE), bias=bias.to(DEVICE))
    if manifest["bytecode"]:
        os.remove(os.path.join(path, "module.mlir"))
        out = tx.load(path)(x.to(DEVICE), bias=bias.to(DEVICE))
        torch.testing.assert_close(out["y"].cpu(), expected["y"], atol=1e-5, rtol=1e-5)


def test_jax_runs_the_saved_module(tmp_path):
    """JAX runs the artifact's StableHLO: the Exported built from its bytecode, and jax.export.deserialize of
    the serialized file (written where JAX can serialize: it needs flatbuffers)."""
    pytest.importorskip("jax")
    import jax

    torch.manual_seed(1)
    model = Head().eval()
    x, bias = torch.randn(3, 4), torch.randn(3)
    path = tx.save(model, str(tmp_path / "head.export"), (x,), {"bias": bias})
    run = tx.load(path)
    manifest = run.manifest
    assert manifest["stablehlo_target"] and manifest["versions"]["jax"] == jax.__version__
    expected = _expected(model, x, bias)
    arguments = run.jax_weights() + [x.numpy(), bias.numpy()]
    outs = run.jax_exported().call(*arguments)
    for got, name in zip(outs, ["y", "total", "shift"]):
        np.testing.assert_allclose(np.asarray(got), expected[name].numpy(), atol=1e-5, rtol=1e-5)
    if manifest["jax_exported"] is None:
        pytest.skip("jax cannot serialize Exported here (flatbuffers is not installed)")
    with open(os.path.join(path, manifest["jax_exported"]), "rb") as f:
        exp = jax.export.deserialize(bytearray(f.read()))
    outs = exp.call(*arguments)
    np.testing.assert_allclose(np.asarray(outs[0]), expected["y"].numpy(), atol=1e-5, rtol=1e-5)


def test_save_a_transformer_block(tmp_path):
    """Every kind of operand (Scalars, view offsets) in a block with attention."""
    torch.manual_seed(2)
    block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    path = tx.save(block, str(tmp_path / "block.export"), (x,))
    out = tx.load(path)(x.to(DEVICE))
    with torch.no_grad():
        torch.testing.assert_close(out.cpu(), block(x), atol=1e-5, rtol=1e-5)


# ---- the module around torch_pjrt's program ------------------------------------------------------------

PROGRAM = """module @torch_pjrt {
  func.func public @main(%arg0: tensor<6xf32>, %arg1: tensor<f32>, %arg2: tensor<i64>) -> (tensor<6xf32>) {
    %v0 = "stablehlo.broadcast_in_dim"(%arg1) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<6xf32> loc(#op0)
    %v1 = "stablehlo.multiply"(%arg0, %v0) : (tensor<6xf32>, tensor<6xf32>) -> tensor<6xf32> loc(#op0)
    %v2 = "stablehlo.convert"(%arg2) : (tensor<i64>) -> tensor<f32> loc(#op1)
    %v3 = "stablehlo.broadcast_in_dim"(%v2) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<6xf32> loc(#op1)
    %v4 = "stablehlo.add"(%v1, %v3) : (tensor<6xf32>, tensor<6xf32>) -> tensor<6xf32> loc(#op1)
    "func.return"(%v4) : (tensor<6xf32>) -> ()
  }
}
// torch_pjrt op locations
#op0 = loc(callsite("aten::mul"("/model.py":6:0) at "torch_pjrt graph op 0":0:0))
#op1 = loc(callsite("aten::add"("/model.py":6:0) at "torch_pjrt graph op 1":0:0))
"""


def test_the_exported_main_takes_shaped_inputs_constants_and_returns_views():
    """Constants become stablehlo.constant ops, inputs are reshaped to their flat storages, and outputs are
    views (with an offset) of a result or of an input."""
    program = _module.Program(
        PROGRAM, [("input", 0), ("constant", torch.float32, (), np.float32(2.5).tobytes()),
                  ("constant", torch.int64, (), np.int64(3).tobytes())], 0,
        [("result", 0, (2, 2), (2, 1), 2), ("input", 0, (3, 2), (2, 1), 0)])
    text = _module.assemble(program, [((3, 2), torch.float32)], [((2, 2), torch.float32), ((3, 2), torch.float32)])
    assert "dense<0x40200000> : tensor<f32>" in text and "dense<3> : tensor<i64>" in text and "loc(" not in text
    x = torch.randn(3, 2)
    run = tx.ModuleFunction(text, [((3, 2), torch.float32)], [((2, 2), torch.float32), ((3, 2), torch.float32)])
    view, same = run([x.to(DEVICE)])
    torch.testing.assert_close(view.cpu(), (x * 2.5 + 3).reshape(-1)[2:6].reshape(2, 2))
    torch.testing.assert_close(same.cpu(), x)


@pytest.mark.parametrize("dtype, value, literal", [
    (torch.float32, 1.0, "dense<0x3F800000>"), (torch.bfloat16, -2.0, "dense<0xC000>"),
    (torch.float64, 0.5, "dense<0x3FE0000000000000>"), (torch.int64, -7, "dense<-7>"), (torch.uint8, 200, "dense<200>"),
    (torch.bool, True, "dense<true>")])
def test_constant_literals_are_exact(dtype, value, literal):
    data = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    assert _module.constant_literal(dtype, (), data) == literal


def test_from_jax_runs_a_jax_export_on_tpu():
    """A jax.export.Exported (an unused argument, which JAX drops from main; two results) runs on tpu."""
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    def f(x, w, unused):
        return jnp.tanh(x @ w), jax.lax.erf(x).sum(0)

    rng = np.random.default_rng(0)
    args = [rng.standard_normal((3, 4), np.float32), rng.standard_normal((4, 5), np.float32), np.zeros(2, np.float32)]
    run = tx.from_jax(jax.export.export(jax.jit(f), platforms=["cpu"])(*args))
    outs = run(*[torch.from_numpy(a) for a in args])
    for got, want in zip(outs, f(*args)):
        assert got.device.type == DEVICE
        np.testing.assert_allclose(got.cpu().numpy(), np.asarray(want), atol=1e-5, rtol=1e-5)
