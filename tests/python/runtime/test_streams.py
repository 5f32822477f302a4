"""Streams of the tpu device (docs/design/streams.md): identity, the current stream per thread, what a stream's
query/synchronize/events see, dependencies as CUDA users write them, and copies between devices.

PJRT has no compute streams: a stream names a sequence of work, each program or copy tagged with the streams
whose ops it carries, and a device's work is ordered by its data. So a read on one stream of what another wrote
sees the writer's value with or without wait_event (CUDA allows either value without it).
"""
import textwrap
import threading

import pytest
import torch

import torch_pjrt
from conftest import run_on_two_devices


def slow_work(stream, n=512, rounds=24):
    """Work on `stream` that takes a good while on the CPU plugin, launched (its graph run once before, since a
    new graph's first run waits for completion) and kept alive by the caller."""
    x = torch.rand(n, n, generator=torch.Generator().manual_seed(3)).to("tpu")
    with torch.tpu.stream(stream):
        for _ in range(rounds):
            x = torch.tanh(x @ x / n)
    stream.query()  # runs the pending graph (fused) without waiting for it
    return x


# ---- identity ---------------------------------------------------------------------------------------------


def test_new_streams_are_distinct_pool_streams_with_priorities():
    default = torch.tpu.default_stream()
    assert default.stream_id == 0 and default.priority == 0
    assert torch.tpu.current_stream() == default
    a, b = torch.tpu.Stream(), torch.tpu.Stream()
    assert a != b and default not in (a, b)
    assert a.device == torch.device("tpu", torch.tpu.current_device()) and a.priority == 0
    high = torch.tpu.Stream(priority=-1)
    assert high.priority == -1 and high not in (a, b)
    assert torch.tpu.Stream.priority_range() == (0, -1)
    # torch.Stream(device="tpu") and torch.Stream(1) style construction take pool streams too.
    c = torch.Stream(device="tpu")
    assert c.device.type == "tpu" and c.stream_id != 0
    # The pools are finite and reused round robin, as CUDA's: 31 normal streams.
    ids = {torch.tpu.Stream().stream_id for _ in range(62)}
    assert len(ids) == 31 and 0 not in ids
    # A stream rebuilt from its id names the same stream.
    same = torch.Stream(stream_id=a.stream_id, device_index=a.device_index, device_type=a.device_type)
    assert same == a


def test_current_stream_is_per_thread_and_restored():
    side = torch.tpu.Stream()
    seen = {}

    def other_thread():
        seen["other"] = torch.tpu.current_stream()

    with torch.tpu.stream(side):
        assert torch.tpu.current_stream() == side == torch.accelerator.current_stream()
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        with torch.tpu.stream(None):  # None keeps the current stream
            assert torch.tpu.current_stream() == side
    assert seen["other"] == torch.tpu.default_stream()
    assert torch.tpu.current_stream() == torch.tpu.default_stream()
    torch.accelerator.set_stream(side)
    try:
        assert torch.tpu.current_stream() == side
    finally:
        torch.tpu.set_stream(torch.tpu.default_stream())
    with side:  # torch.Stream's own context manager
        assert torch.tpu.current_stream() == side
    assert torch.tpu.current_stream() == torch.tpu.default_stream()


def test_a_bad_stream_id_is_refused():
    bad = torch.Stream(stream_id=200, device_index=0, device_type=torch.tpu.default_stream().device_type)
    with pytest.raises(RuntimeError, match="not a stream of a tpu device"):
        bad.query()


# ---- what a stream sees ------------------------------------------------------------------------------------


def test_a_stream_sees_its_own_work_only():
    if torch_pjrt.platform()["name"] != "cpu" or torch_pjrt.get_mode() == "debug":
        pytest.skip("needs slow work that is launched without waiting (debug waits for every program)")
    side, other = torch.tpu.Stream(), torch.tpu.Stream()
    torch.tpu.synchronize()
    slow_work(side)
    torch.tpu.synchronize()  # the graph has run once: the next run is launched without waiting
    x = slow_work(side)
    busy = side.query()
    idle = (other.query(), torch.tpu.default_stream().query())
    event = side.record_event()
    assert not busy, "the side stream's work was done before its query"
    assert idle == (True, True)  # nothing of theirs is in flight
    event.synchronize()
    assert side.query() and event.query()
    want = torch.rand(512, 512, generator=torch.Generator().manual_seed(3))
    for _ in range(24):
        want = torch.tanh(want @ want / 512)
    torch.testing.assert_close(x.cpu(), want, rtol=1e-5, atol=1e-5)


def test_side_stream_synchronize_and_elapsed_time():
    side = torch.tpu.Stream()
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    x = torch.randn(64, 64)
    with torch.tpu.stream(side):
        start.record()
        y = (x.to("tpu") @ x.to("tpu")).relu()
        end.record()
    side.synchronize()
    assert side.query() and end.query()
    assert start.elapsed_time(end) >= 0.0
    torch.testing.assert_close(y.cpu(), (x @ x).relu(), rtol=1e-5, atol=1e-5)


@pytest.mark.modes_inside  # fused mode's graphs, whatever the pass
def test_fused_mode_gives_a_side_stream_its_own_program():
    side = torch.tpu.Stream()
    x = torch.randn(32, 32)
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        before = torch_pjrt.metrics()["graphs"]
        y = x.to("tpu") * 2 + 1  # main stream: recorded
        with torch.tpu.stream(side):
            z = y @ y  # another stream: main's graph runs first, this one is recorded apart
            assert torch_pjrt.metrics()["graphs"] == before + 1
            z = z.relu()
        w = z - y  # back on main: the side stream's graph runs as its own program
        assert torch_pjrt.metrics()["graphs"] == before + 2
        torch.tpu.synchronize()
        assert torch_pjrt.metrics()["graphs"] == before + 3
    want = x * 2 + 1
    torch.testing.assert_close(w.cpu(), (want @ want).relu() - want, rtol=1e-5, atol=1e-4)


# ---- dependencies as CUDA users write them -----------------------------------------------------------------


@pytest.mark.parametrize("wait", ["wait_event", "wait_stream", "none"])
def test_write_on_a_side_stream_read_on_the_main_stream(wait):
    main, side = torch.tpu.current_stream(), torch.tpu.Stream()
    x = torch.randn(128, 128)
    buf = torch.zeros(128, 128, device="tpu")
    side.wait_stream(main)  # buf's zeros are main's work
    with torch.tpu.stream(side):
        buf.copy_(x.to("tpu") @ x.to("tpu"))
        done = torch.tpu.Event()
        done.record()
    if wait == "wait_event":
        main.wait_event(done)
    elif wait == "wait_stream":
        main.wait_stream(side)
    got = (buf * 2).cpu()
    if wait == "none":  # CUDA gives either value; never a crash, a hang or a mix
        assert torch.equal(got, torch.zeros(128, 128)) or torch.allclose(got, 2 * (x @ x), rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got, 2 * (x @ x), rtol=1e-5, atol=1e-4)


def test_record_stream_keeps_memory_until_the_stream_is_done():
    side = torch.tpu.Stream()
    x = torch.randn(256, 256)
    src = x.to("tpu")
    side.wait_stream(torch.tpu.current_stream())
    with torch.tpu.stream(side):
        out = torch.tanh(src @ src)
    src.record_stream(side)
    del src  # freed while the side stream may still read it
    for _ in range(4):
        torch.empty(256, 256, device="tpu").fill_(7.0)  # allocations that could take its memory
    side.synchronize()
    torch.testing.assert_close(out.cpu(), torch.tanh(x @ x), rtol=1e-5, atol=1e-4)  # sums of 256 products


def test_threads_each_with_their_own_stream():
    results, errors = {}, []

    def work(k):
        try:
            s = torch.tpu.Stream()
            with torch.tpu.stream(s):
                assert torch.tpu.current_stream() == s
                y = torch.full((64,), float(k), device="tpu")
                for _ in range(20):
                    y = y * 1.01 + 1
                s.synchronize()
                results[k] = y.cpu()
        except Exception as e:  # reported by the main thread
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert not errors, errors
    for k in range(4):
        want = torch.full((64,), float(k))
        for _ in range(20):
            want = want * 1.01 + 1
        torch.testing.assert_close(results[k], want)


# ---- between devices ---------------------------------------------------------------------------------------

TWO_DEVICES = textwrap.dedent(
    r"""
    import torch, torch_pjrt
    x = torch.randn(64, 32)
    a0 = x.to("tpu:0") * 1
    torch.tpu.synchronize()
    before = torch_pjrt.metrics()
    b1 = a0.to("tpu:1")  # a plugin copy, no host round trip
    after = torch_pjrt.metrics()
    assert b1.device == torch.device("tpu:1")
    assert after["device_to_device_bytes"] - before["device_to_device_bytes"] == x.numel() * 4, (before, after)
    assert after["device_to_host_bytes"] == before["device_to_host_bytes"], "the copy went through the host"
    assert torch.equal(b1.cpu(), x)
    # A cast and a view on the way (copied, then cast and gathered on tpu:1), and copy_ into a slice.
    h = a0.t().to("tpu:1", torch.float16)
    assert torch.equal(h.cpu(), x.t().half())
    dst = torch.zeros(64, 64, device="tpu:1")
    dst[:, 16:48].copy_(a0)
    want = torch.zeros(64, 64); want[:, 16:48] = x
    assert torch.equal(dst.cpu(), want)
    # Streams on two devices: tpu:1's stream waits for an event recorded on tpu:0.
    s0, s1 = torch.tpu.Stream("tpu:0"), torch.tpu.Stream("tpu:1")
    with torch.tpu.stream(s0):
        y0 = (a0 @ a0.t()).relu()
        e = s0.record_event()
    s1.wait_event(e)
    s1.wait_stream(s0)
    with torch.tpu.stream(s1):
        y1 = y0.to("tpu:1") + 1
    s1.synchronize()
    assert torch.allclose(y1.cpu(), (x @ x.t()).relu() + 1, rtol=1e-5, atol=1e-4)
    print("STREAMS_TWO_DEVICES_OK")
    """
)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_copies_between_devices_skip_the_host(mode):
    r = run_on_two_devices(TWO_DEVICES, mode, timeout=180)
    assert r.returncode == 0 and "STREAMS_TWO_DEVICES_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]


# ---- offload through the asynchronous copies ---------------------------------------------------------------


def test_save_on_cpu_offloads_activations_and_gives_cpu_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    tpu_model = model.to("tpu")
    before = torch_pjrt.metrics()["device_to_host_bytes"]
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        loss = tpu_model(x.to("tpu")).square().sum()
    offloaded = torch_pjrt.metrics()["device_to_host_bytes"] - before
    loss.backward()
    assert offloaded >= 8 * 32 * 4  # at least the hidden activations went to the host
    for p, g in zip(tpu_model.parameters(), want):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-5, atol=1e-5)
