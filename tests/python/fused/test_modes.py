"""debug and strict give the same numbers; the mode switches by env var and context manager."""
import os
import subprocess
import sys

import pytest
import torch

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # every test picks its mode(s): once per `make test`


def step(seed):
    torch.tpu.manual_seed(seed)
    x = torch.randn(8, 8, device="tpu")
    w = torch.randn(8, 8, device="tpu", requires_grad=True)
    loss = torch.nn.functional.dropout(x @ w, 0.2).square().mean()
    loss.backward()
    return loss.detach().cpu(), w.grad.cpu()


def test_debug_and_strict_agree():
    with torch_pjrt.mode("debug"):
        assert torch_pjrt.get_mode() == "debug"
        a = step(3)
    with torch_pjrt.mode("strict"):
        b = step(3)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown torch_pjrt mode"):
        torch_pjrt.set_mode("turbo")


def test_mode_from_environment():
    env = dict(os.environ, TORCH_PJRT_MODE="debug", PYTHONPATH=os.pathsep.join(sys.path))
    code = "import torch_pjrt; print(torch_pjrt.get_mode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "debug"


def test_default_mode_is_fused():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_PJRT_MODE"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    code = "import torch_pjrt; print(torch_pjrt.get_mode())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == "fused"


def test_debug_mode_raises_at_the_failing_line():
    # Out-of-range indices are clamped by XLA; debug mode checks them and raises
    # at the user's line instead.
    x = torch.randn(4, device="tpu")
    with torch_pjrt.mode("debug"):
        with pytest.raises(IndexError, match="out of range|out of bounds"):
            x[torch.tensor([7], device="tpu")]


def test_debug_nan_check_raises_at_the_op():
    env = dict(os.environ, TORCH_PJRT_MODE="debug", TORCH_PJRT_CHECK_NANS="1", PYTHONPATH=os.pathsep.join(sys.path))
    code = ("import torch, torch_pjrt\n"
            "x = torch.tensor([1.0, -1.0], device='tpu')\n"
            "y = x * 2\n"
            "try:\n"
            "    torch.log(x)\n"
            "except RuntimeError as e:\n"
            "    print('raised:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "raised:" in out.stdout and "aten::log" in out.stdout and "NaN" in out.stdout
