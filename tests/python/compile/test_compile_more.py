"""torch.compile(backend="tpu"): random ops under replay, and dynamic shapes (what compiles, what replays).

References: PyTorch on the CPU for values; for dropout, its semantics (a fresh
mask per call, the same mask after the same seed, kept values scaled by
1/(1-p), the gradient through the same mask).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import torch_pjrt
from conftest import cpu_and_device

pytestmark = pytest.mark.modes_inside  # every compiled call runs under mode("fused"): once per `make test`

DEVICE = "tpu"


def _replays():
    return torch_pjrt.metrics()["compiled_replays"]


class DropoutNet(nn.Module):
    def __init__(self, p=0.5):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.lin(x))


@pytest.fixture
def dropout_net():
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch_pjrt.mode("fused"):
        yield DropoutNet().to(DEVICE).train()


def _train_call(fn, x):
    x = x.detach().requires_grad_(True)
    out = fn(x)
    out.backward(torch.ones_like(out))
    return out.detach().cpu(), x.grad.cpu()


def test_dropout_replays_with_a_fresh_mask_per_call(dropout_net):
    compiled = torch.compile(dropout_net, backend="tpu")
    x = torch.randn(32, 64, device=DEVICE)
    before = _replays()
    outs = [_train_call(compiled, x)[0] for _ in range(4)]
    # Forward and backward graphs replay after the first call (random ops no longer refuse a plan).
    assert _replays() - before >= 4, torch_pjrt._C._replay_refusal()
    masks = [o != 0 for o in outs]
    for a, b in zip(masks, masks[1:]):
        assert not torch.equal(a, b), "two calls drew the same dropout mask"
    # Kept values are the linear layer's output scaled by 1/(1-p).
    with torch.no_grad():
        expected = dropout_net.lin(x).cpu() * 2
    for out, mask in zip(outs, masks):
        torch.testing.assert_close(out[mask], expected[mask], atol=1e-5, rtol=1e-5)
        assert 0.4 < mask.float().mean().item() < 0.6


def test_same_seed_same_mask_in_captured_and_replayed_calls(dropout_net):
    """The first call runs op by op and captures; later ones replay: both draw the same stream."""
    compiled = torch.compile(dropout_net, backend="tpu")
    x = torch.randn(32, 64, device=DEVICE)
    torch.manual_seed(123)
    first = _train_call(compiled, x)  # captured (op by op)
    _train_call(compiled, x)
    torch.manual_seed(123)
    before = _replays()
    again = _train_call(compiled, x)  # replayed
    assert _replays() - before >= 2
    torch.testing.assert_close(again[0], first[0], atol=0, rtol=0)
    torch.testing.assert_close(again[1], first[1], atol=0, rtol=0)
    # The gradient goes through the same mask: d(sum(dropout(lin(x))))/dx = (mask * 2) @ W.
    mask = (first[0] != 0).float()
    torch.testing.assert_close(first[1], (mask * 2) @ dropout_net.lin.weight.detach().cpu(), atol=1e-5, rtol=1e-5)


def test_replayed_dropout_continues_the_eager_stream(dropout_net):
    """A replay advances the device generator as the op-by-op path does: later eager draws agree."""
    compiled = torch.compile(dropout_net, backend="tpu")
    x = torch.randn(8, 64, device=DEVICE)
    for _ in range(2):
        _train_call(compiled, x)
    streams = []
    for replay in (False, True):
        torch.manual_seed(7)
        if replay:
            before = _replays()
            _train_call(compiled, x)
            assert _replays() > before
        else:
            with torch.no_grad():
                compiled._orig_mod(x)  # the same ops, eager
        streams.append(torch.rand(1000, device=DEVICE).cpu())
    torch.testing.assert_close(streams[0], streams[1], atol=0, rtol=0)


class CheckpointedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def block(self, x):
        return nn.functional.dropout(nn.functional.gelu(self.inp(x)), 0.3, training=True)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.out(checkpoint(self.block, x, use_reentrant=False))


def test_checkpointed_dropout_compiles_and_matches_eager():
    """Activation checkpointing around dropout under torch.compile: AOTAutograd would recompute the dropout in
    backward through torch's RNG-state wrappers, which know no tpu generator (they raised); the backend saves
    the forward's draws instead. After the same seed, outputs and gradients equal eager's on the device (the
    recomputation in eager restores the RNG state, so it draws the forward's mask), calls replay, and each call
    draws a new mask."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch_pjrt.mode("fused"):
        net = CheckpointedDropout().to(DEVICE)
        compiled = torch.compile(net, backend="tpu")
        x = torch.randn(8, 16, device=DEVICE)
        outputs = []
        for step in range(3):
            results = []
            for f in (net, compiled):
                torch.manual_seed(100 + step)
                net.zero_grad()
                out = f(x)
                out.square().sum().backward()
                results.append((out.detach().cpu(), [p.grad.cpu() for p in net.parameters()]))
            (eager_out, eager_grads), (out, grads) = results
            torch.testing.assert_close(out, eager_out, atol=0, rtol=0)
            for g, e in zip(grads, eager_grads):
                torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
            outputs.append(out)
        assert not torch.equal(outputs[0], outputs[1])  # a new mask per seed
        before = _replays()
        compiled(x).sum().backward()
        assert _replays() - before == 2  # forward and backward


# ---- dynamic shapes -----------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 32), nn.GELU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x).softmax(-1)


SIZES = [3, 5, 7, 5, 9, 3, 5]
BUCKETS = {3: 4, 5: 8, 7: 8, 9: 16}


@pytest.mark.parametrize("how", ["dynamic", "mark_dynamic"])
def test_dynamic_batch_runs_at_its_bucket(how):
    """dynamic=True / mark_dynamic on an inference graph that keeps its rows apart: Dynamo traces one graph
    with a symbolic batch size; each batch runs padded to the next power of two and is cut back, so one XLA
    program serves a bucket. A new size inside a seen bucket compiles only its input's pad; a repeated size
    compiles nothing. Every size gives the CPU's values, shapes and strides."""
    from torch_pjrt import _compile

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    width = {"dynamic": 17, "mark_dynamic": 19}[how]  # programs no other test compiled
    cpu = MLP(width)
    bucketed = _compile._bucket_calls[0]
    with torch_pjrt.mode("fused"):
        dev = MLP(width).to(DEVICE)
        dev.load_state_dict(cpu.state_dict())
        compiled = torch.compile(dev, backend="tpu", dynamic=True if how == "dynamic" else None)
        seen, buckets = set(), set()
        for n in SIZES:
            x = torch.randn(n, width)
            xd = x.to(DEVICE)
            if how == "mark_dynamic":
                torch._dynamo.mark_dynamic(xd, 0)
            before = torch_pjrt.metrics()
            with torch.no_grad():
                out = compiled(xd)
                host = out.cpu()
            after = torch_pjrt.metrics()
            # Programs made for this call: compiled, or loaded from a persistent cache.
            compiles = sum(after[k] - before[k] for k in ("compiles", "disk_cache_hits"))
            replays = after["compiled_replays"] - before["compiled_replays"]
            if how == "mark_dynamic" and not seen:
                pass  # the first call traces a static graph: mark_dynamic makes the next ones dynamic
            elif n in seen:
                assert (compiles, replays) == (0, 1), f"size {n} again: {compiles} compiles, {replays} replays"
            elif BUCKETS[n] in buckets:
                assert (compiles, replays) == (1, 1), f"new size {n}, seen bucket: {compiles}, {replays}"
            else:
                assert compiles == 2 and replays == 0, f"new size {n}, new bucket: {compiles}, {replays}"
            seen.add(n)
            buckets.add(BUCKETS[n])
            with torch.no_grad():
                expected = cpu(x)
            assert out.shape == expected.shape and out.stride() == expected.stride()
            torch.testing.assert_close(host, expected, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # one Dynamo graph for every size
    assert _compile._bucket_calls[0] > bucketed


class RowMixers(nn.Module):
    """Ops that make a row depend on other rows or on the batch size: each keeps exact sizes."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(6, 6)

    def forward(self, x, k):
        y = self.lin(x)
        if self.kind == "mean over the batch":
            return y - y.mean(0, keepdim=True)
        if self.kind == "the batch size as a number":
            return y * y.shape[0]
        if self.kind == "batch norm in training":
            return nn.functional.batch_norm(y, None, None, training=True)
        if self.kind == "integer division":
            return k // (k % 3)  # a padded zero row would raise the zero-divisor check
        if self.kind == "dropout":
            return nn.functional.dropout(y, 0.5, training=True)
        if self.kind == "a row index":
            return y[1:] + y[:-1]
        if self.kind == "the batch size as a fill value":
            return y + torch.full((y.shape[0], 1), y.shape[0], device=y.device) + y.new_full((6,), y.shape[0])
        if self.kind == "the batch size as arange's start":
            return y + torch.arange(y.shape[0], y.shape[0] + 6, device=y.device)
        if self.kind == "a reversed arange":
            return y * torch.arange(y.shape[0] - 1, -1, -1, device=y.device).unsqueeze(1)
        return torch.cumsum(y, 0)


@pytest.mark.parametrize("kind", ["mean over the batch", "the batch size as a number", "batch norm in training",
                                  "integer division", "dropout", "a row index", "cumsum over the batch",
                                  "the batch size as a fill value", "the batch size as arange's start",
                                  "a reversed arange"])
def test_graphs_that_mix_rows_keep_exact_batch_sizes(kind):
    from torch_pjrt import _compile

    torch._dynamo.reset()
    torch.manual_seed(0)
    cpu, dev = cpu_and_device(lambda: RowMixers(kind))
    compiled = torch.compile(dev, backend="tpu", dynamic=True)
    bucketed = _compile._bucket_calls[0]
    with torch_pjrt.mode("fused"), torch.no_grad():
        for n in (3, 5, 6):
            x = torch.randn(n, 6)
            k = torch.randint(1, 50, (n, 4)) * 3 + 1
            out = compiled(x.to(DEVICE), k.to(DEVICE))
            if kind == "dropout":  # random: the kept fraction, not the CPU's draws
                assert out.shape == (n, 6)
                continue
            torch.testing.assert_close(out.cpu(), cpu(x, k), atol=1e-5, rtol=1e-5)
    assert _compile._bucket_calls[0] == bucketed, kind


def test_dynamic_shapes_training_replays_per_size():
    """Forward and backward graphs of a dynamic-batch training step replay for a repeated size."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    cpu = MLP()
    with torch_pjrt.mode("fused"):
        dev = MLP().to(DEVICE)
        dev.load_state_dict(cpu.state_dict())
        compiled = torch.compile(dev, backend="tpu", dynamic=True)
        for n in (4, 6, 4, 6):
            x = torch.randn(n, 16)
            dev.zero_grad()
            cpu.zero_grad()
            before = _replays()
            compiled(x.to(DEVICE)).square().sum().backward()
            replayed = _replays() - before
            cpu(x).square().sum().backward()
            for (name, p), q in zip(dev.named_parameters(), cpu.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert replayed == 2, torch_pjrt._C._replay_refusal()  # the last call (a repeated size): both graphs



def test_compiled_graph_over_the_fusion_limits_is_still_one_program(tmp_path):
    """A compiled graph is recorded without fused mode's size cuts (op count, compile cost): with both limits
    far below its 60 ops, the graph still replays as one program, and eager fused mode still cuts."""
    script = textwrap.dedent("""
        import torch, torch_pjrt
        def f(z):
            for _ in range(20):
                z = torch.tanh(z * 0.5 + 0.1)
            return z
        compiled = torch.compile(f, backend="tpu")
        x = torch.randn(8)
        with torch_pjrt.mode("fused"):
            for _ in range(3):
                torch.testing.assert_close(compiled(x.to("tpu")).cpu(), f(x), rtol=1e-5, atol=1e-6)
            replays = torch_pjrt.metrics()["compiled_replays"]
            graphs = torch_pjrt.metrics()["graphs"]
            torch.testing.assert_close(f(x.to("tpu")).cpu(), f(x), rtol=1e-5, atol=1e-6)
            print(replays, torch_pjrt.metrics()["graphs"] - graphs)
    """)
    env = dict(os.environ, TORCH_PJRT_FUSION_LIMIT="10", TORCH_PJRT_FUSION_COST="40", TORCH_PJRT_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    replays, eager_graphs = map(int, out.stdout.split()[-2:])
    assert replays == 2  # calls 2 and 3 ran the captured program
    assert eager_graphs >= 6  # 60 ops in eager fused mode: cut by both limits
