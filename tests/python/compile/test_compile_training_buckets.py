"""torch.compile(backend="tpu", dynamic=True) training graphs at batch buckets.

A training graph with a dynamic batch runs each batch size padded to the next power of two when its rows stay
apart except for reductions that a row mask restricts to the real rows (a sum or mean over the batch, and
cross-entropy's nll_loss). Reference: the same model and steps in PyTorch CPU eager, for losses, outputs,
gradients and parameters after optimizer steps; compile and replay counts from torch_pjrt.metrics().
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt
from conftest import cpu_and_device, programs_and_replays
from torch_pjrt import _compile, _inference_buckets

DEVICE = "tpu"


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inp = nn.Linear(width, 32)
        self.norm = nn.LayerNorm(32)
        self.out = nn.Linear(32, 5)

    def forward(self, x):
        return self.out(F.gelu(self.norm(self.inp(x))))


def losses(model, x, labels):
    """Every reduction the mask handles: cross-entropy (mean), mse_loss, a mean and a sum over the batch, a
    centred batch (a mean over the batch fed back to every row), and an integer count of correct rows."""
    logits = model(x)
    centred = logits - logits.mean(0, keepdim=True)
    loss = (F.cross_entropy(logits, labels) + F.mse_loss(logits[:, :2], x[:, :2]) + 0.1 * logits.pow(2).mean()
            + 0.01 * logits.sum() + centred.square().mean(1).sum() * 0.1)
    correct = (logits.argmax(-1) == labels).sum()
    return loss, logits, correct


SIZES = [3, 5, 7, 5, 9, 3, 6]
BUCKETS = {3: 4, 5: 8, 6: 8, 7: 8, 9: 16}


@pytest.mark.modes_inside  # runs under mode("fused"): once per `make test`
def test_training_graph_runs_at_its_bucket():
    """Losses, logits, counts and gradients equal the CPU's at every size; a repeated size compiles nothing and
    a new size inside a seen bucket compiles no graph program: forward and backward replay the bucket's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    width = 23  # programs no other test compiled
    cpu, dev = cpu_and_device(lambda: Net(width))
    compiled = torch.compile(lambda x, y: losses(dev, x, y), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    seen, buckets = set(), set()
    with torch_pjrt.mode("fused"):
        for n in SIZES:
            x, labels = torch.randn(n, width), torch.randint(0, 5, (n,))
            dev.zero_grad()
            cpu.zero_grad()
            before = torch_pjrt.metrics()
            loss, logits, correct = compiled(x.to(DEVICE), labels.to(DEVICE))
            (loss + logits[:, 0].sum()).backward()  # a gradient through the returned rows too
            host = (loss.cpu(), logits.cpu(), correct.cpu())
            grads = [p.grad.cpu() for p in dev.parameters()]
            programs, replays = programs_and_replays(before, torch_pjrt.metrics())
            expected = losses(cpu, x, labels)
            (expected[0] + expected[1][:, 0].sum()).backward()
            torch.testing.assert_close(host[0], expected[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(host[1], expected[1], atol=1e-5, rtol=1e-5)
            assert host[1].shape == (n, 5) and int(host[2]) == int(expected[2])
            for (name, p), g in zip(cpu.named_parameters(), grads):
                torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"size {n}, {name}: {m}")
            if n in seen:
                assert (programs, replays) == (0, 2), f"size {n} again: {programs} programs, {replays} replays"
            elif BUCKETS[n] in buckets:
                assert replays == 2, f"new size {n} in a seen bucket: {replays} replays"
            else:
                assert replays == 0, f"new size {n}, new bucket: {replays} replays"
            seen.add(n)
            buckets.add(BUCKETS[n])
    assert _compile._bucket_calls[0] - bucketed == sum(1 for n in SIZES if BUCKETS[n] != n)


def test_training_at_buckets_with_an_optimizer_matches_cpu():
    """AdamW steps over a stream of batch sizes: the same losses and final parameters as on the CPU."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    width = 29
    cpu, dev = cpu_and_device(lambda: Net(width))
    compiled = torch.compile(dev, backend="tpu", dynamic=True)
    opt_cpu = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    opt_dev = torch.optim.AdamW(dev.parameters(), lr=1e-2)
    bucketed = _compile._bucket_calls[0]
    for n in [6, 3, 7, 6, 5]:
        x, labels = torch.randn(n, width), torch.randint(0, 5, (n,))
        for model, opt, inp, lab, f in ((cpu, opt_cpu, x, labels, cpu), (dev, opt_dev, x.to(DEVICE),
                                                                           labels.to(DEVICE), compiled)):
            opt.zero_grad()
            loss = F.cross_entropy(f(inp), lab)
            loss.backward()
            opt.step()
            if model is cpu:
                expected = loss.item()
            else:
                assert loss.item() == pytest.approx(expected, abs=1e-5)
    for (name, p), q in zip(dev.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # The model's graph returns rows (the loss is outside it): it keeps its rows apart and runs at buckets.
    assert _compile._bucket_calls[0] > bucketed


def test_two_batch_symbols_pad_only_when_equal():
    """Two inputs whose batch sizes are separate symbols: equal sizes run at the bucket, different sizes run
    exactly (the masks then keep every row); each reduction is masked by its own input's rows."""
    torch._dynamo.reset()
    torch.manual_seed(2)
    lin_cpu, lin = cpu_and_device(lambda: nn.Linear(6, 6))

    def f(lin, x, z):
        return lin(x).tanh().sum() + lin(z).sigmoid().mean()

    compiled = torch.compile(lambda x, z: f(lin, x, z), backend="tpu", dynamic=True)
    for n, m in [(3, 5), (5, 5), (6, 2), (6, 6), (3, 3)]:
        x, z = torch.randn(n, 6), torch.randn(m, 6)
        lin.zero_grad()
        lin_cpu.zero_grad()
        bucketed = _compile._bucket_calls[0]
        out = compiled(x.to(DEVICE), z.to(DEVICE))
        out.backward()
        expected = f(lin_cpu, x, z)
        expected.backward()
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin.weight.grad.cpu(), lin_cpu.weight.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lin.bias.grad.cpu(), lin_cpu.bias.grad, atol=1e-5, rtol=1e-5)
        padded = _compile._bucket_calls[0] > bucketed
        assert padded == (n == m and n not in (1, 2, 4, 8)), (n, m, padded)


class Mixers(nn.Module):
    """Training graphs the mask cannot make exact: each keeps its exact sizes."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6) if kind == "batch norm in training" else None

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "batch norm in training":
            y = self.bn(y)
        elif self.kind == "the batch size as a number":
            y = y * y.shape[0]
        elif self.kind == "a max over the batch":
            y = y - y.amax(0)
        elif self.kind == "a cumsum over the batch":
            y = y.cumsum(0)
        elif self.kind == "a no_grad section":
            with torch.no_grad():
                scale = y.abs().mean(1, keepdim=True)
            y = y / (1 + scale)
        return y.square().mean()


KINDS = ["batch norm in training", "the batch size as a number", "a max over the batch", "a cumsum over the batch",
         "a no_grad section"]


@pytest.mark.parametrize("kind", KINDS)
def test_training_graphs_the_mask_cannot_fix_keep_exact_sizes(kind):
    torch._dynamo.reset()
    torch.manual_seed(3)
    cpu, dev = cpu_and_device(lambda: Mixers(kind))
    compiled = torch.compile(dev, backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5, 6):
        x = torch.randn(n, 6)
        dev.zero_grad()
        cpu.zero_grad()
        loss = compiled(x.to(DEVICE))
        loss.backward()
        expected = cpu(x)
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(dev.named_parameters(), cpu.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        if kind == "batch norm in training":
            torch.testing.assert_close(dev.bn.running_mean.cpu(), cpu.bn.running_mean, atol=1e-5, rtol=1e-5)
    assert _compile._bucket_calls[0] == bucketed, (kind, _compile.bucket_refusal())


def test_buckets_off_runs_exact_sizes(monkeypatch):
    """TORCH_PJRT_BATCH_BUCKETS=0 (read at import) turns training buckets off too."""
    monkeypatch.setattr(_inference_buckets, "_BUCKETS", False)
    torch._dynamo.reset()
    torch.manual_seed(4)
    dev = Net(7).to(DEVICE)
    compiled = torch.compile(lambda x, y: losses(dev, x, y)[0], backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5):
        compiled(torch.randn(n, 7, device=DEVICE), torch.randint(0, 5, (n,), device=DEVICE)).backward()
    assert _compile._bucket_calls[0] == bucketed


def test_autocast_training_at_buckets_matches_cpu_autocast():
    """A bf16 autocast region around the compiled call: the trace holds autocast's casts (AOTAutograd does not
    cast again), so outputs, losses and gradients have the CPU autocast's dtypes and values (bf16 tolerance)."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    width = 31
    cpu, dev = cpu_and_device(lambda: Net(width))

    def loss_of(model, x, labels):
        out = model(x)
        return F.cross_entropy(out, labels) + out.float().pow(2).mean(), out

    compiled = torch.compile(lambda x, y: loss_of(dev, x, y), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5, 6):
        x, labels = torch.randn(n, width), torch.randint(0, 5, (n,))
        dev.zero_grad()
        cpu.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss, out = compiled(x.to(DEVICE), labels.to(DEVICE))
        loss.backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected, expected_out = loss_of(cpu, x, labels)
        expected.backward()
        assert out.dtype == expected_out.dtype == torch.bfloat16 and out.shape == expected_out.shape
        torch.testing.assert_close(out.cpu(), expected_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(loss.cpu(), expected, atol=3e-2, rtol=3e-2)
        for (name, p), q in zip(dev.named_parameters(), cpu.parameters()):
            assert p.grad.dtype == q.grad.dtype
            torch.testing.assert_close(p.grad.cpu(), q.grad, atol=3e-2, rtol=3e-2, msg=lambda m: f"{name}: {m}")
    assert _compile._bucket_calls[0] - bucketed == 3


# ---- what a review found (each was a silent difference from the CPU) ---------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mean_over_the_batch_rounds_once(dtype):
    """A masked mean in half precision sums and divides in float32 and rounds once, as the CPU's mean does: a
    half-precision sum of 30000s overflowed float16 (inf) and rounded bfloat16 twice."""
    torch._dynamo.reset()
    w_cpu = nn.Parameter(torch.ones(4, dtype=dtype))
    w = nn.Parameter(torch.ones(4, dtype=dtype, device=DEVICE))
    compiled = torch.compile(lambda x: (x * w).mean(), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5, 4):
        x = torch.full((n, 4), 30000.0, dtype=dtype)
        out = compiled(x.to(DEVICE))
        assert out.dtype == dtype
        torch.testing.assert_close(out.cpu(), (x * w_cpu).mean(), atol=0, rtol=0)
    assert _compile._bucket_calls[0] - bucketed == 2  # 3 and 5 ran padded


def test_saturated_binary_cross_entropy_keeps_finite_gradients():
    """F.binary_cross_entropy on a sigmoid that is exactly 1.0: ATen's gradient formula clamps, a decomposed
    log(p) would give nan. The op stays whole (exact sizes) and the gradients are the CPU's."""
    torch._dynamo.reset()
    torch.manual_seed(6)
    cpu, dev = cpu_and_device(lambda: nn.Linear(4, 1))

    def loss_of(model, x, target):
        return F.binary_cross_entropy(torch.sigmoid(model(x)).squeeze(1), target)

    compiled = torch.compile(lambda x, t: loss_of(dev, x, t), backend="tpu", dynamic=True)
    for n in (3, 5, 4):
        x = torch.randn(n, 4)
        x[0] = 30.0 * torch.sign(cpu.weight.detach()[0])  # a logit of about 60: sigmoid rounds to 1.0
        target = torch.rand(n)
        dev.zero_grad()
        cpu.zero_grad()
        loss = compiled(x.to(DEVICE), target.to(DEVICE))
        loss.backward()
        expected = loss_of(cpu, x, target)
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(cpu.weight.grad).all()
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=1e-5, rtol=1e-5)


def test_embedding_scaled_by_frequency_keeps_exact_sizes():
    """scale_grad_by_freq divides the table's gradient by index counts, which padded copies of the last row
    would raise: such a graph runs at exact sizes and its gradient is the CPU's."""
    torch._dynamo.reset()
    torch.manual_seed(7)
    cpu, dev = cpu_and_device(lambda: nn.Embedding(16, 3, scale_grad_by_freq=True))
    compiled = torch.compile(lambda ids: dev(ids).sum(), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5, 7):
        ids = torch.arange(n)
        dev.zero_grad()
        cpu.zero_grad()
        compiled(ids.to(DEVICE)).backward()
        cpu(ids).sum().backward()
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=0, rtol=0)
    assert _compile._bucket_calls[0] == bucketed


def test_returned_view_of_an_input_still_aliases_it():
    """A training graph that returns a view of its input: the view must write through to the input (a view of
    a padded copy would not), so such a graph runs at exact sizes."""
    torch._dynamo.reset()
    lin = nn.Linear(4, 2).to(DEVICE)
    compiled = torch.compile(lambda x: (lin(x).sum(), x.view(-1, 2), x[:, :2]), backend="tpu", dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4, device=DEVICE)
        loss, view, part = compiled(x)
        loss.backward()
        view.zero_()
        assert x.abs().sum().item() == 0.0
        part.fill_(2.0)
        assert torch.equal(x[:, :2].cpu(), torch.full((n, 2), 2.0))


# Every Dynamo graph runs fused in every mode; the mode only runs the eager glue between them, the same for
# both families: GPT-2 runs in the fused pass only.
@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.modes_inside), "llama"])
def test_hf_causal_lm_training_at_buckets(family):
    """A transformers causal LM called with labels (the loss computed inside, its labels a separate batch
    symbol after a graph break): every Dynamo graph runs padded, and the loss, logits and every gradient equal
    the CPU's at each batch size."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(8)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model_class = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                          max_position_embeddings=32)
        model_class = transformers.LlamaForCausalLM
    cpu, dev = cpu_and_device(lambda: model_class(config))
    compiled = torch.compile(dev, backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5, 6):
        ids = torch.randint(0, 96, (n, 10))
        dev.zero_grad()
        cpu.zero_grad()
        out = compiled(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE))
        out.loss.backward()
        expected = cpu(input_ids=ids, labels=ids)
        expected.loss.backward()
        torch.testing.assert_close(out.loss.cpu(), expected.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits.cpu(), expected.logits, atol=1e-4, rtol=1e-4)
        for (name, p), q in zip(dev.named_parameters(), cpu.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert _compile._bucket_calls[0] > bucketed, _compile.bucket_refusal()


LOSS_KINDS = ["label smoothing", "per-row losses weighted", "in-place ops on intermediates"]


def _loss_kind(kind, model, x, labels):
    h = model(x)
    if kind == "label smoothing":  # its ignore mask is an in-place masked_fill_ on an intermediate
        return F.cross_entropy(h, labels, label_smoothing=0.1, ignore_index=-100)
    if kind == "per-row losses weighted":  # reduction='none' keeps rows; a batch-free table picked per row
        weights = torch.linspace(0.5, 1.5, 5, device=h.device)
        return (F.cross_entropy(h, labels.clamp(min=0), reduction="none") * weights[labels.clamp(min=0)]).mean()
    h = h.clone()
    h.mul_(2).add_(1).relu_()
    return F.cross_entropy(h, labels)


@pytest.mark.parametrize("kind", LOSS_KINDS)
def test_more_losses_run_at_buckets(kind):
    torch._dynamo.reset()
    torch.manual_seed(9)
    cpu, dev = cpu_and_device(lambda: nn.Linear(8, 5))
    compiled = torch.compile(lambda x, y: _loss_kind(kind, dev, x, y), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5, 6):
        x, labels = torch.randn(n, 8), torch.randint(0, 5, (n,))
        labels[0] = -100  # an ignored row (label smoothing), clamped to class 0 by the others
        dev.zero_grad()
        cpu.zero_grad()
        loss = compiled(x.to(DEVICE), labels.to(DEVICE))
        loss.backward()
        expected = _loss_kind(kind, cpu, x, labels)
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dev.bias.grad.cpu(), cpu.bias.grad, atol=1e-5, rtol=1e-5)
    assert _compile._bucket_calls[0] - bucketed == 3, _compile.bucket_refusal()


def test_in_place_op_on_an_input_keeps_exact_sizes():
    """An in-place op on a batch input would write the padded copy: exact sizes, and the input changes as on
    the CPU."""
    torch._dynamo.reset()
    torch.manual_seed(10)
    cpu, dev = cpu_and_device(lambda: nn.Linear(4, 2))

    def step(model, x):
        x.mul_(2)
        return model(x).square().mean()

    compiled = torch.compile(lambda x: step(dev, x), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n in (3, 5):
        x = torch.randn(n, 4)
        xd = x.to(DEVICE)
        loss = compiled(xd)
        loss.backward()
        expected = step(cpu, x)
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(xd.cpu(), x)
    assert _compile._bucket_calls[0] == bucketed


def test_batch_and_length_vary_in_one_graph():
    """Batch and sequence length both dynamic, the loss over the flattened rows: one Dynamo graph for every
    shape (the trace must not specialize a size), each non-power-of-two batch padded, values the CPU's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(11)
    cpu, dev = cpu_and_device(lambda: nn.Linear(4, 5))

    def f(model, x, labels):
        out = model(x)
        return F.cross_entropy(out.reshape(-1, 5), labels.reshape(-1)) + out.mean((0, 1)).sum(), out

    compiled = torch.compile(lambda x, y: f(dev, x, y), backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    for n, length in ((3, 2), (5, 3), (6, 4), (7, 2), (4, 3)):
        x, labels = torch.randn(n, length, 4), torch.randint(0, 5, (n, length))
        dev.zero_grad()
        cpu.zero_grad()
        loss, out = compiled(x.to(DEVICE), labels.to(DEVICE))
        (loss + out.sum()).backward()
        expected, expected_out = f(cpu, x, labels)
        (expected + expected_out.sum()).backward()
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.cpu(), expected_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert _compile._bucket_calls[0] - bucketed == 4


def test_a_guard_on_the_batch_keeps_a_size_whose_bucket_breaks_it_exact():
    """A branch on the batch size guards the graph (batch <= 5): a batch of 5 would run at 8, outside the
    guard, so it runs exactly; 3 (bucket 4) runs padded. Values are the CPU's either way."""
    torch._dynamo.reset()
    torch.manual_seed(12)
    cpu, dev = cpu_and_device(lambda: nn.Linear(4, 3))

    def f(model, x):
        out = model(x)
        if x.shape[0] > 5:
            out = out * 2
        return out.square().mean()

    compiled = torch.compile(lambda x: f(dev, x), backend="tpu", dynamic=True)
    for n, padded in ((3, True), (5, False), (7, True)):
        x = torch.randn(n, 4)
        dev.zero_grad()
        cpu.zero_grad()
        bucketed = _compile._bucket_calls[0]
        loss = compiled(x.to(DEVICE))
        loss.backward()
        expected = f(cpu, x)
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad, atol=1e-5, rtol=1e-5)
        assert (_compile._bucket_calls[0] > bucketed) == padded, n
