"""torch_pjrt.register_lowering: a JAX function as an ATen op's lowering, against PyTorch on the CPU.

A registration lasts for the process, so each check runs in a fresh interpreter (in the test's mode).
"""
import os
import subprocess
import sys
import textwrap

import pytest

import torch_pjrt

pytest.importorskip("jax")


def run(script):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def test_override_builtin_lowering_all_forms():
    run("""
        import jax, jax.numpy as jnp, torch, torch_pjrt
        traced = []
        def my_tanh(a):
            traced.append(a.shape)
            return 2 * jax.nn.sigmoid(2 * a) - 1
        torch_pjrt.register_lowering("aten::tanh", my_tanh)
        assert torch_pjrt.op_traits("aten::tanh_")["user_lowering"]
        x = torch.randn(5, 7)
        t = x.to("tpu")
        torch_pjrt.reset_metrics()
        y = torch.tanh(t)
        z = t.clone(); z.tanh_()
        o = torch.empty(5, 7, device="tpu"); torch.tanh(t, out=o)
        h = torch.tanh(t.half())
        got = [y.cpu(), z.cpu(), o.cpu(), h.cpu()]
        assert traced, "the JAX function was never lowered"
        assert torch_pjrt.metrics()["cpu_fallbacks"] == {}, torch_pjrt.metrics()["cpu_fallbacks"]
        for g in got[:3]:
            torch.testing.assert_close(g, torch.tanh(x), atol=1e-6, rtol=1e-5)
        assert got[3].dtype == torch.float16
        torch.testing.assert_close(got[3], torch.tanh(x.half()), atol=1e-3, rtol=1e-3)
        # A second registration replaces the first, also where the old one was compiled already.
        torch_pjrt.register_lowering("aten::tanh", lambda a: jnp.tanh(a) * 0 + 3)
        torch.testing.assert_close(torch.tanh(t).cpu(), torch.full((5, 7), 3.0))
    """)


def test_lowering_for_op_that_ran_on_cpu():
    run("""
        import jax, jax.numpy as jnp, torch, torch_pjrt
        x = torch.rand(4, 6) * 2
        t = x.to("tpu")
        torch_pjrt.reset_metrics()
        torch.special.erfcx(t).cpu()
        assert "aten::special_erfcx" in torch_pjrt.metrics()["cpu_fallbacks"]  # the CPU ran it before
        assert not torch_pjrt.op_traits("aten::special_erfcx")
        torch_pjrt.register_lowering("aten::special_erfcx", lambda a: jnp.exp(a * a) * jax.scipy.special.erfc(a))
        assert torch_pjrt.op_traits("aten::special_erfcx")["lowering"]
        torch_pjrt.reset_metrics()
        y = torch.special.erfcx(t).cpu()
        assert torch_pjrt.metrics()["cpu_fallbacks"] == {}, torch_pjrt.metrics()["cpu_fallbacks"]
        torch.testing.assert_close(y, torch.special.erfcx(x), atol=1e-5, rtol=1e-4)
        # Inside a larger graph: fuses with the ops around it.
        torch.testing.assert_close((torch.special.erfcx(t * 0.5) + 1).cpu(), torch.special.erfcx(x * 0.5) + 1,
                                   atol=1e-5, rtol=1e-4)
    """)


def test_wrong_result_shape_raises():
    run("""
        import jax.numpy as jnp, torch, torch_pjrt
        torch_pjrt.register_lowering("aten::tanh", lambda a: jnp.tanh(a).sum())
        try:
            torch.tanh(torch.randn(3, device="tpu")).cpu()
        except Exception as e:
            assert "shape" in str(e), e
        else:
            raise AssertionError("no error for a result of the wrong shape")
    """)


def test_op_traits_from_the_registry():
    assert torch_pjrt.op_traits("aten::add_.Tensor")["elementwise"]
    assert "alpha_check" in torch_pjrt.op_traits("aten::add.out")["cpu_rules"]
    assert torch_pjrt.op_traits("aten::nonzero")["skip_decomposition"]
    assert torch_pjrt.op_traits("aten::mode.values")["route"] == "to_lowering"
    assert torch_pjrt.op_traits("aten::mode") is None  # the overload's rule only
    assert torch_pjrt.op_traits("aten::copy_")["route"] == "keep_generic"
    assert torch_pjrt.op_traits("sum", platform="cpu")["platform"] == "cpu"
    assert torch_pjrt.op_traits("sum", platform="tpu")["platform"] == ""  # the portable rule
    assert torch_pjrt._C._op_base_name("aten::add_.Tensor") == "add"
    assert torch_pjrt._C._op_base_name("aten::__iand__.Tensor") == "__iand__"


def test_call_setting_an_argument_the_function_cannot_see_runs_on_cpu():
    # fn gets only tensors: add's alpha=2 must not be silently dropped, before or after alpha=1 was planned.
    run("""
        import torch, torch_pjrt
        torch_pjrt.register_lowering("aten::add.Tensor", lambda a, b: a + b)
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        a, b = x.to("tpu"), y.to("tpu")
        torch_pjrt.reset_metrics()
        torch.testing.assert_close(torch.add(a, b).cpu(), x + y)
        assert torch_pjrt.metrics()["cpu_fallbacks"] == {}, torch_pjrt.metrics()["cpu_fallbacks"]
        for alpha in (2, 0.5, 1.0, -3):
            torch.testing.assert_close(torch.add(a, b, alpha=alpha).cpu(), torch.add(x, y, alpha=alpha))
        assert "aten::add.Tensor" in torch_pjrt.metrics()["cpu_fallbacks"]
    """)


def test_decorator_platform_and_no_kernel_override_warning():
    run("""
        import warnings
        import jax.numpy as jnp, torch, torch_pjrt
        here = torch_pjrt.platform()["name"]
        other = "tpu" if here != "tpu" else "cuda"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            @torch_pjrt.register_lowering("aten::tanh", platform=here)
            def three(a):
                return jnp.tanh(a) * 0 + 3

            # A rule for another plugin is kept apart: this process's tanh is the one above.
            torch_pjrt.register_lowering("aten::tanh", lambda a: jnp.tanh(a) * 0 + 4, platform=other)
        assert callable(three) and three(jnp.zeros(2)).tolist() == [3.0, 3.0]  # the decorator returns fn
        assert not [w for w in caught if "Overriding" in str(w.message)], [str(w.message) for w in caught]
        x = torch.randn(3, 4)
        torch.testing.assert_close(torch.tanh(x.to("tpu")).cpu(), torch.full((3, 4), 3.0))
        torch.testing.assert_close(torch.tanh(x), x.tanh())  # the CPU's own kernel is untouched
        try:
            torch_pjrt.register_lowering("aten::tanh", lambda a: a, platform="rocm")
        except ValueError as e:
            assert "platform" in str(e)
        else:
            raise AssertionError("an unknown platform was accepted")
    """)
