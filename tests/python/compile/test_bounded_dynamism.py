"""torch.compile(backend="tpu") with bounded dynamism: torch._dynamo.mark_dynamic(t, dim, min=, max=).

A batch dim marked dynamic within [min, max] runs at power-of-two buckets clipped to max: no program is made
for a size beyond the bound. A size outside the bound does what Dynamo does with backend="eager" on the CPU:
on a tensor marked with the bound, Dynamo's ConstraintViolationError ("n not in range [min, max]"); on an
unmarked tensor, a recompile (a second graph, without the bound). References: PyTorch CPU eager for values,
backend="eager" for what Dynamo does, torch_pjrt.metrics() for the programs made.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import torch_pjrt
from conftest import cpu_and_device, programs_and_replays
from torch_pjrt import _inference_buckets

pytestmark = pytest.mark.modes_inside  # every compiled call runs under mode("fused"): once per `make test`

DEVICE = "tpu"


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, 16), nn.GELU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.net(x).softmax(-1)


@pytest.fixture
def bucket_sizes(monkeypatch):
    """The (batch, size run at) of every bucketed graph call."""
    runs = []
    plan = _inference_buckets._BatchBuckets.plan

    def recording(self, args):
        result = plan(self, args)
        runs.append((result[0], result[3]))
        return result

    monkeypatch.setattr(_inference_buckets._BatchBuckets, "plan", recording)
    return runs


# min=3, max=12: buckets 4, 8 and 12 (16 clipped to the bound).
BOUNDED = {3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 9: 12, 10: 12, 11: 12, 12: 12}


def test_sizes_inside_the_bound_reuse_bucket_programs_clipped_to_max(bucket_sizes):
    """Each size runs at its bucket, the last bucket clipped to max=12 (never 16); a new bucket makes two
    programs (the input's pad and the graph), a new size in a seen bucket one (its pad), a size equal to its
    bucket or seen before none: the graph program replays. Values, shapes and strides equal the CPU's."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    width = 37  # programs no other test compiled
    cpu, dev = cpu_and_device(lambda: MLP(width))
    compiled = torch.compile(dev, backend="tpu")
    seen, buckets = set(), set()
    with torch_pjrt.mode("fused"):
        for n in [5, 7, 9, 12, 11, 3, 4, 6, 10, 7, 12]:
            x = torch.randn(n, width)
            xd = x.to(DEVICE)
            torch._dynamo.mark_dynamic(xd, 0, min=3, max=12)
            before = torch_pjrt.metrics()
            with torch.no_grad():
                out = compiled(xd)
                host = out.cpu()
            programs, replays = programs_and_replays(before, torch_pjrt.metrics())
            bucket = BOUNDED[n]
            assert bucket_sizes[-1] == (n, bucket)
            if n in seen or n == bucket and bucket in buckets:
                assert (programs, replays) == (0, 1), f"size {n}: {programs} programs, {replays} replays"
            elif bucket in buckets:
                assert (programs, replays) == (1, 1), f"new size {n}, seen bucket: {programs}, {replays}"
            else:
                expected = 1 if n == bucket else 2  # the graph's program, and the pad's unless n is the bucket
                assert (programs, replays) == (expected, 0), f"new size {n}, new bucket: {programs}, {replays}"
            seen.add(n)
            buckets.add(bucket)
            with torch.no_grad():
                expected = cpu(x)
            assert out.shape == expected.shape and out.stride() == expected.stride()
            torch.testing.assert_close(host, expected, atol=1e-5, rtol=1e-5)
    assert max(size for _, size in bucket_sizes) == 12
    assert counters["stats"]["unique_graphs"] == 1  # one Dynamo graph for the whole bound


def _outside_the_bound(backend, make, n):
    """What a compiled call does with a tensor of n rows marked dynamic within [3, 8], after one inside."""
    fn = make()
    compiled = torch.compile(fn, backend=backend)
    device = DEVICE if backend == "tpu" else "cpu"
    x = torch.randn(4, 6, device=device)
    torch._dynamo.mark_dynamic(x, 0, min=3, max=8)
    with torch.no_grad():
        compiled(x)
    y = torch.randn(n, 6, device=device)
    torch._dynamo.mark_dynamic(y, 0, min=3, max=8)
    with torch.no_grad():
        return compiled(y)


@pytest.mark.parametrize("n", [2, 9, 16])
def test_a_marked_size_outside_the_bound_raises_as_dynamo_does(n):
    """Dynamo's own check: the guard on the bound fails, the retrace finds the marked size outside [min, max]
    and raises ConstraintViolationError, with backend="eager" on the CPU and with backend="tpu" alike."""
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    torch.manual_seed(0)
    messages = []
    for backend in ("eager", "tpu"):
        torch._dynamo.reset()
        with torch_pjrt.mode("fused"), pytest.raises(ConstraintViolationError) as info:
            _outside_the_bound(backend, lambda: (lambda x: (x * 2).sum(1)), n)
        messages.append(str(info.value).splitlines()[0])
    assert messages[0] == messages[1] == f"{n} not in range [3, 8]"


def test_an_unmarked_size_outside_the_bound_recompiles_as_dynamo_does(bucket_sizes):
    """An unmarked tensor outside the bound fails the bound's guard: Dynamo traces a second graph (with
    backend="eager" too), whose batch has no bound, so it runs at the unclipped bucket. Values equal the CPU's."""
    torch.manual_seed(0)
    graphs = {}
    width = 41  # programs no other test compiled
    for backend in ("eager", "tpu"):
        torch._dynamo.reset()
        counters.clear()
        cpu, dev = cpu_and_device(lambda: MLP(width))
        model = dev if backend == "tpu" else cpu
        compiled = torch.compile(model, backend=backend)
        with torch_pjrt.mode("fused"), torch.no_grad():
            for n, mark in [(5, True), (7, True), (11, False), (13, False), (6, True)]:
                x = torch.randn(n, width)
                xd = x.to(DEVICE) if backend == "tpu" else x.clone()
                if mark:
                    torch._dynamo.mark_dynamic(xd, 0, min=3, max=8)
                out = compiled(xd)
                torch.testing.assert_close(out.cpu(), cpu(x), atol=1e-5, rtol=1e-5)
        graphs[backend] = counters["stats"]["unique_graphs"]
    assert graphs["tpu"] == graphs["eager"] == 2
    assert bucket_sizes == [(5, 8), (7, 8), (11, 16), (13, 16), (6, 8)]


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.inp = nn.Linear(width, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        return self.out(F.gelu(self.inp(x)))


def test_training_graph_buckets_are_clipped_to_max(bucket_sizes):
    """A training graph (loss and backward) with a bounded batch: 5 and 6 rows run at 6 (max), not 8; the
    loss and every gradient equal the CPU's (the padded rows are masked out of the mean)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    width = 43  # programs no other test compiled
    cpu, dev = cpu_and_device(lambda: Net(width))
    compiled = torch.compile(lambda x, y: F.cross_entropy(dev(x), y), backend="tpu")
    with torch_pjrt.mode("fused"):
        for n in [3, 5, 6, 5]:
            x, labels = torch.randn(n, width), torch.randint(0, 3, (n,))
            xd, ld = x.to(DEVICE), labels.to(DEVICE)
            torch._dynamo.mark_dynamic(xd, 0, min=2, max=6)
            torch._dynamo.mark_dynamic(ld, 0, min=2, max=6)
            dev.zero_grad()
            cpu.zero_grad()
            loss = compiled(xd, ld)
            loss.backward()
            expected = F.cross_entropy(cpu(x), labels)
            expected.backward()
            torch.testing.assert_close(loss.detach().cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
            for (name, p), q in zip(dev.named_parameters(), cpu.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert bucket_sizes == [(3, 4), (5, 6), (6, 6), (5, 6)]


@pytest.mark.parametrize("upper, n, bucket", [(None, 5, 8), (8, 5, 8), (10, 9, 10), (10, 10, 10), (6, 3, 4),
                                              (7, 7, 7), (1000, 513, 1000), (None, 513, 1024)])
def test_bucket_is_the_next_power_of_two_clipped_to_the_upper_bound(upper, n, bucket):
    assert _inference_buckets._bucket(n, upper) == bucket
