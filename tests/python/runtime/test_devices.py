"""Several devices in one process, and synchronize / Event / Stream.

The device count is fixed when the runtime starts, so the two-device cases run
in a subprocess with TORCH_PJRT_CPU_DEVICES=2 (one per mode, under a hard
timeout); the event cases run here on tpu:0.
"""
import textwrap
import time

import pytest
import torch

import torch_pjrt
from conftest import run_on_two_devices

TWO_DEVICES = textwrap.dedent(
    r"""
    import threading
    import torch, torch_pjrt
    assert torch.tpu.device_count() == 2, torch.tpu.device_count()

    def close(a, b):
        assert a.device.type == "cpu" and torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a, b)

    # The same op, then the same small model, on tpu:0 and tpu:1: same plans,
    # programs compiled per device.
    torch.manual_seed(0)
    x = torch.randn(4, 6)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    want = model(x)
    for d in ("tpu:0", "tpu:1", "tpu:0"):
        y = (x.to(d) * 2 + 1).sin()
        assert y.device == torch.device(d), y.device
        close(y.cpu(), (x * 2 + 1).sin())
        m = __import__("copy").deepcopy(model).to(d)
        out = m(x.to(d))
        assert out.device == torch.device(d)
        close(out.cpu(), want)
        out.sum().backward()
        assert m[0].weight.grad.device == torch.device(d)

    # Interleaved recording on both devices: each device keeps its own graph.
    a0, a1 = x.to("tpu:0"), x.to("tpu:1")
    b0 = a0 + 1
    b1 = a1 * 3
    c0 = b0.exp()
    c1 = b1 - 2
    close(c1.cpu(), x * 3 - 2)
    close(c0.cpu(), (x + 1).exp())

    # Copies between devices, both ways, and of a view.
    z = a0.to("tpu:1")
    assert z.device == torch.device("tpu:1")
    close(z.cpu(), x)
    close(a1.t()[1:].to("tpu:0").cpu(), x.t()[1:])
    w = torch.zeros(4, 6, device="tpu:0")
    w.copy_(a1 * 2)
    close(w.cpu(), x * 2)

    # Factories that reach the device's kernels directly (arange, linspace, eye, scalar_tensor) honour their
    # device argument, whatever the current device (they used to land on it).
    for make in (lambda d: torch.arange(6, device=d), lambda d: torch.arange(2, 9, 3, device=d),
                 lambda d: torch.linspace(0, 1, 5, device=d), lambda d: torch.eye(3, device=d),
                 lambda d: torch.scalar_tensor(2.5, device=d), lambda d: torch.full((2, 3), 7, device=d)):
        t = make("tpu:1")
        assert t.device == torch.device("tpu:1"), (t.device, make("cpu"))
        assert torch.equal(t.cpu(), make("cpu")), (t.cpu(), make("cpu"))
        assert torch.equal((t + make("tpu:1")).cpu(), make("cpu") * 2)

    # A compiled function on each device: every device's call runs the program compiled for that
    # device (a replay plan carries its device), interleaved, against the CPU.
    f = torch.compile(lambda a, b: (a @ b).relu() + a.sum(), backend="tpu")
    for d in ("tpu:0", "tpu:1", "tpu:0", "tpu:1", "tpu:1"):
        out = f(x.to(d), x.t().contiguous().to(d) * 0.5)
        assert out.device == torch.device(d), out.device
        close(out.cpu(), (x @ x.t() * 0.5).relu() + x.sum())

    # An op mixing devices raises PyTorch's error.
    for bad in (lambda: a0 + a1, lambda: torch.mm(a0, a1.t()), lambda: a0.add_(a1)):
        try:
            bad()
        except RuntimeError as e:
            assert "Expected all tensors to be on the same device" in str(e), e
        else:
            raise AssertionError("mixing tpu:0 and tpu:1 did not raise")

    # Per-device RNG: manual_seed reproduces each device's stream; the devices'
    # generators are separate (drawing on one leaves the other's state).
    def draws(d):
        with torch.tpu.device(d):
            torch.tpu.manual_seed(7)
        first = torch.rand(5, device=d).cpu()
        torch.rand(3, device="tpu:1" if d == "tpu:0" else "tpu:0")  # the other device draws in between
        return first, torch.rand(5, device=d).cpu()
    r0, r1 = draws("tpu:0"), draws("tpu:1")
    again = draws("tpu:0")
    assert torch.equal(r0[0], again[0]) and torch.equal(r0[1], again[1])
    assert torch.equal(r0[0], r1[0])  # same seed, same stream on each device
    assert not torch.equal(r0[0], r0[1])
    g1 = torch.Generator(device="tpu:1").manual_seed(3)
    u = torch.rand(4, device="tpu:1", generator=g1).cpu()
    g1.manual_seed(3)
    assert torch.equal(u, torch.rand(4, device="tpu:1", generator=g1).cpu())

    # Two threads, each driving its own device with a training loop (the
    # initial weights come from the main thread: the CPU generator is shared).
    torch.manual_seed(1)
    init = torch.nn.Linear(6, 1)
    results, errors = {}, []
    def train(d):
        try:
            m = __import__("copy").deepcopy(init).to(d)
            opt = torch.optim.SGD(m.parameters(), lr=0.1)
            xd, yd = x.to(d), x.sum(1, keepdim=True).to(d)
            for _ in range(5):
                opt.zero_grad()
                torch.nn.functional.mse_loss(m(xd), yd).backward()
                opt.step()
            torch.tpu.synchronize(d)
            results[d] = m.weight.detach().cpu()
        except Exception as e:  # reported by the main thread
            errors.append(repr(e))
    threads = [threading.Thread(target=train, args=(d,)) for d in ("tpu:0", "tpu:1")]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    m = init
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    close(results["tpu:0"], m.weight.detach())
    close(results["tpu:1"], m.weight.detach())

    # synchronize(d) and events on tpu:1.
    e = torch.tpu.Event()
    v = a1 @ a1.t()
    e.record(torch.tpu.current_stream("tpu:1"))
    assert e.device == torch.device("tpu:1")
    e.synchronize()
    assert e.query()
    torch.tpu.synchronize("tpu:1")
    torch.accelerator.synchronize(1)
    close(v.cpu(), x @ x.t())
    print("TWO_DEVICES_OK")
    """
)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_two_devices_in_one_process(mode):
    r = run_on_two_devices(TWO_DEVICES, mode, timeout=120)
    assert r.returncode == 0 and "TWO_DEVICES_OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("sync", ["accelerator", "tpu", "stream"])
def test_synchronize_runs_the_pending_graph(sync):
    wait = {"accelerator": torch.accelerator.synchronize, "tpu": torch.tpu.synchronize,
            "stream": lambda: torch.tpu.current_stream().synchronize()}[sync]
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        x = torch.ones(8, device="tpu")
        before = torch_pjrt.metrics()["graphs"]
        y = x * 3 + 1
        assert torch_pjrt.metrics()["graphs"] == before  # recorded, not run
        wait()
        assert torch_pjrt.metrics()["graphs"] == before + 1
        z = y - 1
        e = torch.tpu.Event()
        e.record()  # an event covers the recorded ops without cutting the graph
        assert torch_pjrt.metrics()["graphs"] == before + 1
        e.synchronize()  # runs them
        assert torch_pjrt.metrics()["graphs"] == before + 2
    assert torch.equal(z.cpu(), torch.full((8,), 3.0))


def test_event_record_query_synchronize_elapsed():
    torch.accelerator.synchronize()
    start = torch.tpu.Event(enable_timing=True)
    end = torch.tpu.Event(enable_timing=True)
    x = torch.randn(256, 256, device="tpu")
    start.record()
    for _ in range(10):
        x = torch.tanh(x @ x)
    end.record()
    end.synchronize()
    assert end.query() and start.query()
    ms = start.elapsed_time(end)
    assert 0.0 <= ms < 60_000.0
    # The span is the device's: positive (the work between the records takes
    # time) and within the host's wall time around it.
    big = torch.randn(512, 512, device="tpu")
    s2, e2 = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    torch.tpu.synchronize()
    t0 = time.perf_counter()
    s2.record()
    for _ in range(40):
        big = torch.tanh(big @ big)
    e2.record()
    e2.synchronize()  # as on CUDA, elapsed_time needs both events completed
    wall_ms = (time.perf_counter() - t0) * 1000.0
    assert 0.0 < s2.elapsed_time(e2) <= wall_ms + 1.0
    untimed = torch.tpu.Event()
    untimed.record()
    with pytest.raises(ValueError, match="enable_timing"):
        start.elapsed_time(untimed)


def test_event_query_sees_unfinished_work():
    torch.accelerator.synchronize()
    x = torch.randn(1024, 1024, device="tpu")
    e = torch.tpu.Event()
    for _ in range(30):
        x = x @ x / 1024
    e.record()
    states = [e.query()]
    e.synchronize()
    states.append(e.query())
    assert states[-1] is True
    # An event recorded with nothing in flight is complete at once.
    torch.tpu.synchronize()
    idle = torch.tpu.Event()
    idle.record()
    assert idle.query()


def test_stream_api():
    s = torch.tpu.current_stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", torch.tpu.current_device())
    assert s == torch.tpu.default_stream() != torch.tpu.Stream()  # Stream() takes a pool stream (test_streams.py)
    y = torch.ones(4, device="tpu") + 1
    ev = s.record_event()
    torch.tpu.Stream().wait_event(ev)
    s.wait_stream(torch.tpu.Stream())
    s.synchronize()
    assert s.query() and ev.query()
    assert torch.equal(y.cpu(), torch.full((4,), 2.0))
