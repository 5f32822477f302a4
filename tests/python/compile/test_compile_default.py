"""torch.compile with no backend argument (Inductor) on tpu tensors, flex_attention, and no global module hooks.

torch 2.13's Inductor takes device `tpu` for TorchTPU and would generate Pallas kernels importing torch_tpu:
graphs that touch a tpu tensor are sent to the `tpu` backend wherever Inductor is entered, and graphs without
one still reach Inductor. Every result is compared with CPU PyTorch.
"""
import copy
import os
import subprocess
import sys
import textwrap
import tomllib
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import torch_pjrt
from torch_pjrt import _compile
from conftest import cpu_and_device, tiny_model

pytestmark = pytest.mark.modes_inside  # compiled graphs run fused whatever the mode: each test picks its own

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # tests/python/<layer>/ -> repo


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _train_twice(model, x, compile_kwargs):
    """Two compiled forward + backward calls: outputs and gradients of each (the second call replays)."""
    compiled = torch.compile(model, **compile_kwargs)
    results = []
    for _ in range(2):
        model.zero_grad()
        out = compiled(x)
        out.square().mean().backward()
        results.append([out.detach().cpu()] + [p.grad.cpu() for p in model.parameters()])
    return results


@pytest.mark.parametrize("compile_kwargs", [{}, {"mode": "max-autotune"}, {"mode": "reduce-overhead"},
                                            {"options": {"max_autotune": True, "coordinate_descent_tuning": True}}],
                         ids=["default", "max-autotune", "reduce-overhead", "options"])
def test_default_compile_forward_and_backward_match_cpu(compile_kwargs):
    torch.manual_seed(0)
    cpu, dev = cpu_and_device(_mlp)
    x = torch.randn(5, 8)
    torch._dynamo.reset()
    routed = _compile._routed_graphs[0]
    want = _train_twice(cpu, x, {"backend": "eager"})
    got = _train_twice(dev, x.to("tpu"), compile_kwargs)
    assert _compile._routed_graphs[0] > routed  # Inductor's entry sent the graph to the tpu backend
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["strict", "lazy", "debug"])
def test_default_compile_in_other_modes(mode):
    # The compiled graph runs fused whatever the mode; the graph break's eager op runs in the caller's mode.
    torch.manual_seed(0)
    cpu, dev = cpu_and_device(_mlp)
    x = torch.randn(5, 8)

    def step(model, t):
        h = model(t)
        torch._dynamo.graph_break()
        return (h.exp() * 2).sum()

    torch._dynamo.reset()
    want = torch.compile(step, backend="eager")(cpu, x)
    want.backward()
    with torch_pjrt.mode(mode):
        got = torch.compile(step)(dev, x.to("tpu"))
        got.backward()
        torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=1e-5, atol=1e-5)
        for a, b in zip(dev.parameters(), cpu.parameters()):
            torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-5)


def test_factory_only_graph_on_tpu():
    # No tensor input: the graph's tpu tensor is one it makes.
    torch._dynamo.reset()

    @torch.compile
    def make(n: int):
        return torch.arange(n, device="tpu", dtype=torch.float32).sin() * 2

    torch.testing.assert_close(make(6).cpu(), torch.arange(6, dtype=torch.float32).sin() * 2)


def test_registry_inductor_name_routes_tpu_graphs():
    # torch._dynamo's registry entry "inductor" (what a string backend resolves to outside torch.compile's wrapper).
    from torch._dynamo.backends.registry import lookup_backend

    torch._dynamo.reset()
    x = torch.randn(4, 4)
    routed = _compile._routed_graphs[0]
    fn = torch.compile(lambda t: (t @ t).relu() + 1, backend=lookup_backend("inductor"))
    torch.testing.assert_close(fn(x.to("tpu")).cpu(), (x @ x).relu() + 1)
    assert _compile._routed_graphs[0] == routed + 1


def test_cpu_graphs_still_reach_inductor():
    torch._dynamo.reset()
    routed = _compile._routed_graphs[0]
    x = torch.randn(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no global-hook warning from torch.compile(module)
        out = torch.compile(torch.nn.Tanh())(x)
    torch.testing.assert_close(out, torch.tanh(x))
    assert _compile._routed_graphs[0] == routed


def test_no_global_module_hooks():
    from torch.nn.modules import module as nn_module

    assert not nn_module._has_any_global_hook()
    model = _mlp()
    assert not model._forward_hooks
    model.to("tpu")
    assert not nn_module._has_any_global_hook()
    # The end-of-inference cut sits on the module that was moved, its submodules keep the fast call path.
    assert len(model._forward_hooks) == 1 and len(model._forward_pre_hooks) == 1
    assert all(not m._forward_hooks for m in model.children())
    model.to("tpu")
    assert len(model._forward_hooks) == 1  # once
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.compile(model, backend="eager")(torch.randn(2, 8, device="tpu"))
    model.cpu()
    assert not model._forward_hooks and not model._forward_pre_hooks and not model._forward_hooks_always_called


def _assert_each_call_ends_a_graph(cpu, dev):
    x = torch.randn(3, 8)
    with torch_pjrt.mode("fused"), torch.no_grad():
        torch_pjrt.sync()
        graphs = torch_pjrt.metrics()["graphs"]
        outs = [dev(x.to("tpu")) for _ in range(3)]
        assert torch_pjrt.metrics()["graphs"] - graphs >= 3  # one graph per call, without reading anything
        for out in outs:
            torch.testing.assert_close(out.cpu(), cpu(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", ["device_context", "device_argument"])
def test_inference_cut_on_a_model_built_on_the_device(build):
    # Never moved, so no .to() put the cut on it: eval() on the outermost module does (not on its children).
    torch.manual_seed(0)
    cpu = _mlp()
    if build == "device_context":
        with torch.device("tpu"):
            dev = _mlp()
    else:
        dev = torch.nn.Sequential(torch.nn.Linear(8, 16, device="tpu"), torch.nn.GELU(),
                                  torch.nn.LayerNorm(16, device="tpu"), torch.nn.Linear(16, 4, device="tpu"))
    assert not dev._forward_hooks
    dev.load_state_dict(cpu.state_dict())
    dev.eval()
    assert len(dev._forward_hooks) == 1 and all(not m._forward_hooks for m in dev.children())
    _assert_each_call_ends_a_graph(cpu, dev)
    cpu.eval()
    assert not cpu._forward_hooks  # a CPU model's calls keep the fast path


def test_inference_cut_still_ends_each_moved_module_call():
    torch.manual_seed(0)
    cpu, dev = cpu_and_device(_mlp)
    _assert_each_call_ends_a_graph(cpu, dev)


# ---- Hugging Face models ----------------------------------------------------

def _generate(model, ids, **kw):
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static",
              **kw)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kw)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_compiled_forward_and_generate_match_cpu(kind):
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = tiny_model(kind)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_logits = model(ids).logits
    want_tokens = _generate(model, ids, disable_compile=True)
    with torch_pjrt.mode("fused"):
        model.to("tpu")
        routed = _compile._routed_graphs[0]
        with torch.no_grad():
            logits = torch.compile(model)(ids.to("tpu")).logits
        assert _compile._routed_graphs[0] > routed
        torch.testing.assert_close(logits.cpu(), want_logits, rtol=1e-4, atol=1e-5)
        # transformers compiles the static-cache decode step: with Inductor and reduce-overhead
        # (CompileConfig's defaults), and with the backend it picks for device `tpu` itself.
        routed = _compile._routed_graphs[0]
        tokens = _generate(model, ids.to("tpu"), compile_config=transformers.CompileConfig())
        assert _compile._routed_graphs[0] > routed
        torch.testing.assert_close(tokens.cpu(), want_tokens, rtol=0, atol=0)
        del model._compiled_call
        torch.testing.assert_close(_generate(model, ids.to("tpu")).cpu(), want_tokens, rtol=0, atol=0)


# ---- flex_attention -----------------------------------------------------------

B, H, S, D = 2, 2, 16, 8


def _score_mod(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1 + h * 0.5


def _mask_mod(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 6)  # causal, sliding window: some blocks empty, some partial


def _dense_attention(q, k, v):
    """flex_attention's definition in plain CPU ops (CPU flex_attention has no backward)."""
    scores = q @ k.transpose(-1, -2) / D ** 0.5
    b, h = torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    q_idx, kv_idx = torch.arange(S).view(1, 1, S, 1), torch.arange(S).view(1, 1, 1, S)
    scores = _score_mod(scores, b, h, q_idx, kv_idx).masked_fill(~_mask_mod(b, h, q_idx, kv_idx), float("-inf"))
    return scores.softmax(-1) @ v


def _flex_case():
    torch.manual_seed(0)
    return [torch.randn(B, H, S, D) for _ in range(3)]


def _check_flex(fn, mode):
    q, k, v = _flex_case()
    want = flex_attention(q, k, v, score_mod=_score_mod,
                          block_mask=create_block_mask(_mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=4))
    torch.testing.assert_close(_dense_attention(q, k, v), want, rtol=1e-5, atol=1e-6)  # the reference is flex's
    cq, ck, cv = [t.clone().requires_grad_() for t in (q, k, v)]
    _dense_attention(cq, ck, cv).square().sum().backward()
    with torch_pjrt.mode(mode):
        dq, dk, dv = [t.to("tpu").requires_grad_() for t in (q, k, v)]
        block_mask = create_block_mask(_mask_mod, None, None, S, S, device="tpu", BLOCK_SIZE=4)
        for _ in range(2):  # the second call finds its programs (compiled: replays)
            for t in (dq, dk, dv):
                t.grad = None
            out = fn(dq, dk, dv, score_mod=_score_mod, block_mask=block_mask)
            out.square().sum().backward()
            torch.testing.assert_close(out.detach().cpu(), want, rtol=1e-5, atol=1e-6)
            for got, ref in zip((dq, dk, dv), (cq, ck, cv)):
                torch.testing.assert_close(got.grad.cpu(), ref.grad, rtol=1e-5, atol=1e-5)
    assert not torch_pjrt.metrics()["cpu_fallbacks"].get("aten::bmm")


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_flex_attention_eager_forward_and_backward(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        _check_flex(flex_attention, mode)


def test_flex_attention_compiled_with_inductor_options():
    # TorchTitan's way: torch.compile(flex_attention) with Inductor options, no backend argument.
    torch._dynamo.reset()
    routed = _compile._routed_graphs[0]
    compiled = torch.compile(flex_attention, options={"max_autotune": True, "coordinate_descent_tuning": True,
                                                      "triton.cudagraphs": False})
    _check_flex(compiled, "fused")
    assert _compile._routed_graphs[0] > routed


def test_compiled_create_block_mask_matches_cpu():
    # TorchTitan compiles create_block_mask too.
    torch._dynamo.reset()
    want = create_block_mask(_mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=4)
    got = torch.compile(create_block_mask)(_mask_mod, None, None, S, S, device="tpu", BLOCK_SIZE=4)
    for a, b in zip(got.as_tuple(), want.as_tuple()):
        if isinstance(b, torch.Tensor):
            assert a.device.type == "tpu"
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0)
        else:
            assert a == b or callable(b)


def test_flex_attention_compiled_inside_a_module():
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, options={"max_autotune": True})
    block_cpu = create_block_mask(_mask_mod, None, None, S, S, device="cpu", BLOCK_SIZE=4)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D)

        def forward(self, x, block_mask, attention):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return attention(q, k, v, score_mod=_score_mod, block_mask=block_mask).sum(1)

    x = torch.randn(B, H, S, D)
    cpu, dev = cpu_and_device(Attention)
    cpu_out = cpu(x, block_cpu, lambda q, k, v, **kw: _dense_attention(q, k, v))
    cpu_out.square().mean().backward()
    out = dev(x.to("tpu"), create_block_mask(_mask_mod, None, None, S, S, device="tpu", BLOCK_SIZE=4), compiled)
    out.square().mean().backward()
    torch.testing.assert_close(out.detach().cpu(), cpu_out.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(dev.parameters(), cpu.parameters()):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-5)


# ---- the Dynamo entry point -------------------------------------------------

def test_installed_package_lists_tpu_backend_right_after_import_torch(tmp_path):
    # The metadata an install writes from pyproject.toml's entry points, on the path of a fresh interpreter.
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        groups = tomllib.load(f)["project"]["entry-points"]
    assert groups["torch_dynamo_backends"]["tpu"]
    info = tmp_path / "torch_pjrt-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_pjrt\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
        for group, entries in groups.items()))
    script = textwrap.dedent("""
        import sys, torch
        assert "torch_pjrt" in sys.modules  # the torch.backends autoload
        assert "tpu" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        x = torch.randn(3, 3)
        fn = torch.compile(lambda t: t.exp() - 1, backend="tpu")
        torch.testing.assert_close(fn(x.to("tpu")).cpu(), x.exp() - 1)
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(ROOT, "python")]))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_torch_jit_script_of_a_tpu_module_ignores_the_cut_hooks():
    cpu = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    dev = copy.deepcopy(cpu).to("tpu")
    scripted = torch.jit.script(dev)
    x = torch.randn(5, 4)
    torch.testing.assert_close(scripted(x.to("tpu")).cpu(), cpu(x))
    assert any(fn.__name__ == "_module_exit" for fn in dev._forward_hooks.values())  # the eager module keeps them
