"""torch.compile(..., backend="tpu") against eager PyTorch on the CPU."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt

DEVICE = "tpu"
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(torch.tanh(self.fc1(x)))))


class Block(nn.Module):
    """A tiny pre-norm transformer block with causal attention."""

    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        # No qkv bias: the key bias has a zero gradient (softmax ignores it), and
        # AdamW turns rounding noise in a zero gradient into lr-sized steps.
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _pair(make):
    torch.manual_seed(0)
    cpu = make()
    dev = copy.deepcopy(cpu).to(DEVICE)
    return cpu, dev


def _train(model, x, steps, compiled_step):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    forward = torch.compile(model, backend="tpu") if compiled_step else model

    def step():
        opt.zero_grad(set_to_none=True)
        loss = forward(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    if compiled_step:
        opt_step = torch.compile(opt.step, backend="tpu")

        def step():  # noqa: F811: the compiled variant
            opt.zero_grad(set_to_none=True)
            loss = forward(x).square().mean()
            loss.backward()
            opt_step()
            return loss

    return [step().detach() for _ in range(steps)]


@pytest.mark.parametrize("make,shape", [(MLP, (6, 12)), (Block, (2, 8, 16))], ids=["mlp", "transformer_block"])
def test_forward_backward_adamw_match_cpu(make, shape):
    cpu, dev = _pair(make)
    x = torch.randn(*shape)
    expected = _train(cpu, x, 3, compiled_step=False)
    actual = _train(dev, x.to(DEVICE), 3, compiled_step=True)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a.cpu(), e, **TOL)
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), **TOL, msg=lambda m: f"{name}: {m}")
    assert torch_pjrt.metrics()["cpu_fallbacks"] == {}


def _executions(fn):
    torch_pjrt.sync()
    torch.tpu.synchronize()
    before = torch_pjrt.metrics()["executions"]
    result = fn()
    after = torch_pjrt.metrics()["executions"]
    return result, after - before


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_one_program_per_forward_and_backward(mode):
    cpu, dev = _pair(Block)
    compiled = torch.compile(dev, backend="tpu")
    x = torch.randn(2, 8, 16)
    xd = x.to(DEVICE)
    params = list(dev.parameters())
    with torch_pjrt.mode(mode):
        for _ in range(3):  # the first call compiles; the later ones must repeat it
            out, forward_programs = _executions(lambda: compiled(xd))
            seed = torch.ones_like(out)
            grads, backward_programs = _executions(lambda: torch.autograd.grad(out, params, seed))
            assert forward_programs == 1
            assert backward_programs == 1
    expected = cpu(x)
    torch.testing.assert_close(out.cpu(), expected.detach(), **TOL)
    expected_grads = torch.autograd.grad(expected, list(cpu.parameters()), torch.ones_like(expected))
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g.cpu(), e, **TOL)


def test_no_recompile_on_repeated_calls():
    cpu, dev = _pair(MLP)
    compiled = torch.compile(dev, backend="tpu")
    xs = [torch.randn(6, 12) for _ in range(5)]
    for x in xs[:2]:  # the second call accumulates into .grad: its first graph of that
        compiled(x.to(DEVICE)).sum().backward()
    torch_pjrt.sync()
    before = torch_pjrt.metrics()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for x in xs[2:]:
            out = compiled(x.to(DEVICE))
            out.sum().backward()
            torch.testing.assert_close(out.cpu(), cpu(x).detach(), **TOL)
    after = torch_pjrt.metrics()
    # Every XLA program of the later calls was found by the fused graph cache.
    assert after["graphs"] - before["graphs"] == after["graph_cache_hits"] - before["graph_cache_hits"]


def test_graph_break_runs_in_fused_eager():
    def f(x, w):
        y = torch.sin(x @ w)
        print("graph break")  # Dynamo cannot trace print: two graphs around an eager call
        torch._dynamo.graph_break()
        return (y * 2 + x.sum()).relu()

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    compiled = torch.compile(f, backend="tpu")
    out = compiled(x.to(DEVICE), w.to(DEVICE))
    torch.testing.assert_close(out.cpu(), f(x, w), **TOL)


def test_dynamic_shapes_give_correct_results():
    cpu, dev = _pair(MLP)
    compiled = torch.compile(dev, backend="tpu", dynamic=True)
    for rows in (3, 5, 9, 5):
        x = torch.randn(rows, 12)
        torch.testing.assert_close(compiled(x.to(DEVICE)).cpu(), cpu(x).detach(), **TOL)


def test_mark_dynamic_gives_correct_results():
    cpu, dev = _pair(MLP)
    compiled = torch.compile(dev, backend="tpu")
    for rows in (4, 7):
        x = torch.randn(rows, 12)
        xd = x.to(DEVICE)
        torch._dynamo.mark_dynamic(xd, 0)
        torch.testing.assert_close(compiled(xd).cpu(), cpu(x).detach(), **TOL)


def test_inference_under_no_grad():
    cpu, dev = _pair(Block)
    compiled = torch.compile(dev, backend="tpu")
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        out, programs = _executions(lambda: compiled(x.to(DEVICE)))
    assert programs == 1
    torch.testing.assert_close(out.cpu(), cpu(x).detach(), **TOL)


def test_error_in_compiled_program_names_user_line():
    torch_pjrt._C._inject_compile_fault("aten::cos")

    def f(x):
        y = x + 1
        return torch.cos(y)  # the faulty op's line

    try:
        with pytest.raises(RuntimeError) as info:
            torch.compile(f, backend="tpu")(torch.randn(3, device=DEVICE)).cpu()
    finally:
        torch_pjrt._C._inject_compile_fault("")
    message = str(info.value)
    assert "aten::cos" in message
    assert f"test_compile_backend.py:{f.__code__.co_firstlineno + 2}" in message, message


def test_backend_is_registered():
    from torch._dynamo import list_backends

    torch.compile(lambda x: x, backend="tpu")
    assert "tpu" in list_backends(exclude_tags=())


def test_hf_gpt2_static_cache_generation_matches_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=64)
    torch.manual_seed(0)
    cpu = transformers.GPT2LMHeadModel(config).eval()
    dev = copy.deepcopy(cpu).to(DEVICE)
    prompt = torch.randint(0, 101, (1, 5))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = cpu.generate(prompt, **kwargs)
    dev.generation_config.cache_implementation = "static"
    dev.forward = torch.compile(dev.forward, backend="tpu")
    actual = dev.generate(prompt.to(DEVICE), **kwargs)
    assert actual.cpu().tolist() == expected.tolist()


def test_later_calls_replay_the_program_with_new_values():
    cpu, dev = _pair(Block)
    compiled = torch.compile(dev, backend="tpu")
    params = list(dev.parameters())
    for step in range(4):
        x = torch.randn(2, 8, 16)
        before = torch_pjrt.metrics()["compiled_replays"]
        out = compiled(x.to(DEVICE))
        grads = torch.autograd.grad(out, params, torch.ones_like(out))
        replays = torch_pjrt.metrics()["compiled_replays"] - before
        if step >= 1:
            assert replays == (0 if torch_pjrt.get_mode() == "debug" else 2)  # forward and backward
        expected = cpu(x)
        torch.testing.assert_close(out.detach().cpu(), expected.detach(), **TOL)
        expected_grads = torch.autograd.grad(expected, list(cpu.parameters()), torch.ones_like(expected))
        for g, e in zip(grads, expected_grads):
            torch.testing.assert_close(g.cpu(), e, **TOL)


def test_replay_falls_back_when_input_layout_changes():
    def f(x, y):
        return (x * 2 + y).sin()

    compiled = torch.compile(f, backend="tpu")
    base, y = torch.randn(40), torch.randn(6, 6)
    base_dev, y_dev = base.to(DEVICE), y.to(DEVICE)
    # Same sizes and strides (Dynamo's guards pass), other storage offsets and sizes.
    for start in (0, 0, 4, 2, 0):
        x_dev = base_dev[start:start + 36].view(6, 6)
        torch.testing.assert_close(compiled(x_dev, y_dev).cpu(), f(base[start:start + 36].view(6, 6), y), **TOL)
    torch.testing.assert_close(compiled(y_dev, y_dev).cpu(), f(y, y), **TOL)  # one storage as both inputs
    torch.testing.assert_close(compiled(y_dev.t(), y_dev).cpu(), f(y.t(), y), **TOL)


def test_random_ops_draw_fresh_numbers_every_call():
    compiled = torch.compile(lambda x: F.dropout(x, 0.5, training=True) + x.exp(), backend="tpu")
    x = torch.ones(64, device=DEVICE)
    a, b, c = (compiled(x).cpu() for _ in range(3))
    assert not torch.equal(a, b) and not torch.equal(b, c)
    kept = (a - x.cpu().exp()) != 0
    torch.testing.assert_close(a[kept], torch.full_like(a[kept], 2 + 1.0 * torch.e), **TOL)


def test_compiled_optimizer_step_updates_parameters_in_place():
    cpu, dev = _pair(MLP)
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    step = torch.compile(opt_dev.step, backend="tpu")
    ids = [id(p) for p in dev.parameters()]
    for _ in range(4):
        x = torch.randn(6, 12)
        for model, opt in ((cpu, opt_cpu), (dev, opt_dev)):
            opt.zero_grad()
            model(x.to(next(model.parameters()).device)).square().mean().backward()
        opt_cpu.step()
        torch_pjrt.sync()
        torch.tpu.synchronize()
        before = torch_pjrt.metrics()["executions"]
        step()
        if torch_pjrt.get_mode() == "fused":  # the whole AdamW step: one program (the eager
            # bits Dynamo leaves around its graph run as separate programs in strict mode)
            assert torch_pjrt.metrics()["executions"] - before == 1
    assert [id(p) for p in dev.parameters()] == ids
    for p, q in zip(cpu.parameters(), dev.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), **TOL)


def test_replay_reads_inputs_computed_by_pending_ops():
    def f(x, w):
        return (x @ w).relu() - x.sum()

    compiled = torch.compile(f, backend="tpu")
    w = torch.randn(5, 5)
    w_dev = w.to(DEVICE)
    replays = torch_pjrt.metrics()["compiled_replays"]
    for k in range(4):
        base = torch.randn(3, 5)
        x_dev = base.to(DEVICE) * (k + 1)  # recorded, not yet run, when the compiled call starts
        w_dev.add_(0.5)  # an in-place update of an input, also pending
        w = w + 0.5
        torch.testing.assert_close(compiled(x_dev, w_dev).cpu(), f(base * (k + 1), w), **TOL)
    assert torch_pjrt.metrics()["compiled_replays"] - replays == (0 if torch_pjrt.get_mode() == "debug" else 3)
