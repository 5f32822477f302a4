"""Event.record does not cut the pending fused graph (FSDP2 records one per
stream sync); query / synchronize / wait on another device / elapsed_time run
the graph first when the event's point is still in it, so an event still
completes only after all work recorded before it."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # every test picks its mode: once per `make test`


def graphs():
    return torch_pjrt.metrics()["graphs"]


def pending_work():
    """Recorded (fused) ops and their CPU reference."""
    x_cpu = torch.randn(64, 64)
    x = x_cpu.to("tpu")
    y = torch.tanh(x @ x) + 1
    return y, torch.tanh(x_cpu @ x_cpu) + 1


def test_record_does_not_run_the_pending_graph():
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        before = graphs()
        y, ref = pending_work()
        e = torch.tpu.Event()
        e.record()
        e2 = torch.tpu.current_stream().record_event()
        torch.tpu.current_stream().wait_event(e2)  # same device: ordered by data, nothing to run
        assert graphs() == before
        z = y * 2  # still the same graph
        assert graphs() == before
        e.synchronize()  # runs it
        assert graphs() == before + 1
        assert e.query() and e2.query()
        assert graphs() == before + 1  # the graph ran once for both events
    torch.testing.assert_close(z.cpu(), ref * 2)


def test_query_after_record_runs_and_sees_the_work():
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        before = graphs()
        y, ref = pending_work()
        e = torch.tpu.Event()
        e.record()
        assert graphs() == before
        polls = 0
        while not e.query():  # the first query runs the graph; it must finish
            polls += 1
            assert polls < 10_000_000
        assert graphs() == before + 1
        # Done means done: the outputs are ready without another program.
        torch.testing.assert_close(y.cpu(), ref)
        assert graphs() == before + 1


def test_synchronize_after_record_waits_for_work_recorded_before():
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        x = torch.randn(512, 512, device="tpu")
        for _ in range(20):
            x = torch.tanh(x @ x / 512)
        e = torch.tpu.Event()
        e.record()
        e.synchronize()
        assert e.query()
        done = graphs()
        x.cpu()
        assert graphs() == done  # the event's synchronize ran everything before it


def test_graph_run_elsewhere_resolves_the_event():
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        before = graphs()
        y, ref = pending_work()
        e = torch.tpu.Event()
        e.record()
        torch.testing.assert_close(y.cpu(), ref)  # the read runs the graph
        assert graphs() == before + 1
        e.synchronize()
        assert e.query()
        assert graphs() == before + 1  # nothing left to run for the event


def test_rerecord_covers_the_new_point():
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        e = torch.tpu.Event()
        y, _ = pending_work()
        e.record()
        e.synchronize()
        before = graphs()
        z = y + 1
        e.record()
        assert graphs() == before
        e.synchronize()
        assert graphs() == before + 1
        assert e.query()
    torch.testing.assert_close(z.cpu(), y.cpu() + 1)


@pytest.mark.parametrize("mode", ["fused", "lazy", "strict", "debug"])
def test_event_with_nothing_pending_or_running_is_complete(mode):
    with torch_pjrt.mode(mode):
        torch.tpu.synchronize()
        e = torch.tpu.Event()
        before = graphs()
        e.record()
        assert e.query()
        e.synchronize()
        assert graphs() == before


def test_elapsed_time_positive_and_ordered():
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        a, b, c = (torch.tpu.Event(enable_timing=True) for _ in range(3))
        x = torch.randn(384, 384, device="tpu")
        a.record()
        for _ in range(20):
            x = torch.tanh(x @ x / 384)
        b.record()
        for _ in range(20):
            x = torch.tanh(x @ x / 384)
        c.record()
        c.synchronize()
        ab, ac, bc = a.elapsed_time(b), a.elapsed_time(c), b.elapsed_time(c)
        assert ab > 0.0 and bc > 0.0
        assert ac >= ab and ac >= bc
        assert abs(ac - (ab + bc)) < 1e-3 * max(ac, 1.0)


TWO_DEVICES = textwrap.dedent(
    """
    import torch, torch_pjrt
    with torch_pjrt.mode("fused"):
        torch.tpu.synchronize()
        x_cpu = torch.randn(256, 256)
        x = x_cpu.to("tpu:0")
        for _ in range(10):
            x = torch.tanh(x @ x / 256)
        before = torch_pjrt.metrics()["graphs"]
        e = torch.tpu.Event()
        e.record(torch.tpu.current_stream("tpu:0"))
        assert torch_pjrt.metrics()["graphs"] == before, "record ran the graph"
        # tpu:1 waits for tpu:0's event: tpu:0's pending graph must run first.
        torch.tpu.current_stream("tpu:1").wait_event(e)
        assert torch_pjrt.metrics()["graphs"] == before + 1, "wait did not run the graph"
        assert e.query(), "the event is not complete after a cross-device wait"
        y = x.to("tpu:1") * 2
        ref = x_cpu
        for _ in range(10):
            ref = torch.tanh(ref @ ref / 256)
        torch.testing.assert_close(y.cpu(), ref * 2)
    print("CROSS_DEVICE_WAIT_OK")
    """
)


def test_cross_device_wait_runs_the_graph_then_waits():
    env = dict(os.environ, TORCH_PJRT_CPU_DEVICES="2")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    r = subprocess.run([sys.executable, "-c", TWO_DEVICES], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "CROSS_DEVICE_WAIT_OK" in r.stdout, r.stderr[-3000:]
