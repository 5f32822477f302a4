"""Nothing lost, nothing hangs: many Python threads on one tensor, and fork.

Threads: PyTorch releases the GIL inside every op, so threads really run ops
at once. On the CPU each in-place op is a read-modify-write of memory that
takes a few microseconds, so N threads doing M `add_(1)` end with +N*M (and
disjoint writes into one tensor all survive); the tpu device must give the
same. Every test runs under a timeout so that a deadlock fails instead of
hanging the suite.

Fork: the cases run in fresh interpreters (subprocess with a hard timeout), so
a hang in a forked child fails the test instead of blocking it.
"""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import torch_pjrt

MODES = ["strict", "fused", "debug", "lazy"]
THREADS = 4


@pytest.fixture(params=MODES)
def mode(request):
    with torch_pjrt.mode(request.param):
        yield request.param


def run_threads(target, count=THREADS, timeout=240):
    """Runs `target(i)` on `count` threads; re-raises the first error; fails on a hang."""
    errors = []

    def body(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread did not finish: deadlock?"
    if errors:
        raise errors[0]


def sequential_cpu(n_threads, work):
    """What CPU PyTorch ends with: each thread's ops applied whole, one after another."""
    for i in range(n_threads):
        work(i)


@pytest.mark.timeout(600)
def test_concurrent_add_keeps_every_update(mode):
    steps = 60
    expected = torch.zeros(5)
    sequential_cpu(THREADS, lambda i: [expected.add_(1) for _ in range(steps)])
    x = torch.zeros(5, device="tpu")
    run_threads(lambda i: [x.add_(1) for _ in range(steps)])
    torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=0)


@pytest.mark.timeout(600)
def test_concurrent_writes_to_disjoint_slices_all_survive(mode):
    # The storage starts without a buffer: the first writes race to create it.
    for _ in range(3):
        expected = torch.zeros(THREADS, 3)
        sequential_cpu(THREADS, lambda i: expected[i].fill_(i + 1))
        x = torch.empty(THREADS, 3, device="tpu")
        run_threads(lambda i: x[i].fill_(i + 1))
        torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=0)


@pytest.mark.timeout(600)
def test_concurrent_read_modify_write_on_views(mode):
    # Each thread updates its own column of a shared matrix, with the
    # in-place op on a strided view (a write_view of the whole storage).
    steps = 15
    base = torch.arange(12.0).reshape(3, 4)
    expected = base.clone()
    sequential_cpu(THREADS, lambda i: [expected[:, i].mul_(2).add_(1) for _ in range(steps)])
    x = base.to("tpu")
    run_threads(lambda i: [x[:, i].mul_(2).add_(1) for _ in range(steps)])
    torch.testing.assert_close(x.cpu(), expected, rtol=0, atol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["host", "device"])
def test_reader_sees_old_or_new_value_while_a_writer_copies(mode, source):
    values = [float(v) for v in range(4)]
    hosts = [torch.full((256,), v) for v in values]
    devices = [h.to("tpu") for h in hosts]
    x = torch.full((256,), -1.0, device="tpu")
    done = threading.Event()
    seen = set()

    def writer():
        try:
            for k in range(120):
                x.copy_((hosts if source == "host" else devices)[k % 4])
                if k % 10 == 0 and mode in ("fused", "lazy"):
                    torch_pjrt.sync()
        finally:
            done.set()

    def reader():
        while not done.is_set():
            v = x.cpu()
            assert (v == v[0]).all(), "a read mixed two values"
            assert v[0].item() in values + [-1.0]
            seen.add(v[0].item())

    run_threads(lambda i: writer() if i == 0 else reader(), count=3)
    assert x.cpu()[0].item() == values[119 % 4]


@pytest.mark.timeout(600)
def test_metrics_count_every_op_from_every_thread(mode):
    steps = 40
    x = torch.zeros(3, device="tpu")
    x.add_(1)
    torch_pjrt.sync()
    before = torch_pjrt.metrics()
    stop = threading.Event()

    def poll_metrics():
        while not stop.is_set():
            m = torch_pjrt.metrics()
            assert m["lowered_ops"].get("aten::add_.Tensor", 0) >= before["lowered_ops"]["aten::add_.Tensor"]

    poller = threading.Thread(target=poll_metrics, daemon=True)
    poller.start()
    try:
        run_threads(lambda i: [x.add_(1) for _ in range(steps)])
    finally:
        stop.set()
        poller.join(60)
    assert x.cpu()[0].item() == 1 + THREADS * steps
    after = torch_pjrt.metrics()
    ops = THREADS * steps
    assert after["lowered_ops"]["aten::add_.Tensor"] - before["lowered_ops"]["aten::add_.Tensor"] == ops
    counter = "fused_ops" if mode in ("fused", "lazy") else "executions"
    assert after[counter] - before[counter] == ops
    assert after["op_cache_hits"] + after["op_cache_misses"] - before["op_cache_hits"] - before["op_cache_misses"] >= ops


@pytest.mark.timeout(600)
def test_threads_that_sync_while_others_record_do_not_deadlock():
    # sync()/synchronize() are called with the GIL held while recording threads
    # take the GIL to note their source line: neither may wait on the other.
    x = torch.zeros(4, device="tpu")

    def body(i):
        for k in range(40):
            if i == 0:
                torch_pjrt.sync()
                torch.tpu.synchronize()
            else:
                x.add_(1)

    run_threads(body)
    assert x.cpu()[0].item() == (THREADS - 1) * 40
