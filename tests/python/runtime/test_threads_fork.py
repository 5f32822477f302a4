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

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

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


# ---- fork -------------------------------------------------------------------

def run_python(code, mode="fused", timeout=180):
    """Runs `code` in a fresh interpreter; a hang fails the test (TimeoutExpired)."""
    env = dict(os.environ, TORCH_PJRT_MODE=mode, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("mode", ["strict", "fused", "lazy"])
def test_cpu_only_dataloader_workers_run_after_the_parent_used_the_device(mode):
    # Before the fix, fused mode hung here: the end-of-module hook synced in the
    # worker, which compiled the parent's pending graph in the forked child.
    # The parent leaves recorded ops pending (fused, lazy) and live tensors;
    # workers run an nn.Module under no_grad (fused mode's end-of-module hook),
    # collect garbage (freeing inherited tensors) and seed torch (which seeds
    # every device whose module is not in a bad fork).
    out = run_python("""
        import gc, torch, torch_pjrt
        from torch.utils.data import DataLoader, Dataset
        w = torch.randn(3, 3)
        w_dev = w.to("tpu")
        # A program compiled and run before the fork: the plugin's thread pools
        # exist, and a child that compiles or runs would wait on them forever.
        torch.testing.assert_close((w_dev * 3).cpu(), w * 3)
        pending = w_dev * 2 + 1
        garbage = [torch.ones(2, device="tpu")]
        garbage.append(garbage)
        del garbage
        scale = torch.nn.Linear(2, 3)

        class Data(Dataset):
            def __len__(self):
                return 16
            def __getitem__(self, i):
                gc.collect()
                assert torch.tpu._is_in_bad_fork()
                with torch.no_grad():
                    return scale(torch.tensor([float(i), 1.0]))

        loader = DataLoader(Data(), batch_size=4, num_workers=2)
        got = torch.cat([(b.to("tpu") @ w_dev).cpu() for b in loader])
        with torch.no_grad():
            rows = torch.stack([scale(torch.tensor([float(i), 1.0])) for i in range(16)])
        torch.testing.assert_close(got, rows @ w)
        torch.testing.assert_close(pending.cpu(), w * 2 + 1)
        assert not torch.tpu._is_in_bad_fork()
        print("ok")
    """, mode=mode)
    assert out.strip().endswith("ok")


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_forked_child_that_uses_the_device_raises_at_once(mode):
    out = run_python("""
        import os, torch, torch_pjrt
        x = torch.arange(4.0, device="tpu")
        pending = x + 1
        print("parent", x.cpu().tolist(), flush=True)
        side = torch.tpu.Stream()  # work of a side stream in flight at the fork
        with torch.tpu.stream(side):
            m = torch.rand(256, 256).to("tpu")
            for _ in range(8):
                m = torch.tanh(m @ m / 256)
        side.query()
        pid = os.fork()
        if pid == 0:
            results = [torch.tpu._is_in_bad_fork(), torch.tpu.device_count()]
            for attempt in (lambda: torch.ones(2, device="tpu"), lambda: x.add_(1), lambda: pending.cpu(),
                            lambda: x.cpu(), lambda: torch_pjrt.sync(), lambda: torch.tpu.synchronize(),
                            lambda: torch.tpu._lazy_init(), lambda: torch.zeros(2).to("tpu"),
                            lambda: side.query(), lambda: side.synchronize(), lambda: torch.tpu.Stream(),
                            lambda: side.record_event()):
                try:
                    attempt()
                    results.append("no error")
                except RuntimeError as e:
                    results.append("forked subprocess" in str(e) and "spawn" in str(e))
            print("child", results, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        assert not torch.tpu._is_in_bad_fork()
        print("parent after", (pending * 2).cpu().tolist(), flush=True)
        side.synchronize()
        print("parent side", bool(torch.isfinite(m.cpu()).all()), flush=True)
    """, mode=mode, timeout=120)
    lines = out.strip().splitlines()
    assert lines[0] == "parent [0.0, 1.0, 2.0, 3.0]"
    # The child: a bad fork that still knows the device count; every device use raises the fork error.
    assert lines[1] == "child " + str([True, torch.tpu.device_count()] + [True] * 12)
    assert lines[2] == "parent after [2.0, 4.0, 6.0, 8.0]"
    assert lines[3] == "parent side True"


def test_dataloader_worker_that_uses_the_device_fails_with_the_fork_error():
    out = run_python("""
        import torch, torch_pjrt
        from torch.utils.data import DataLoader, Dataset
        torch.ones(2, device="tpu").cpu()

        class Data(Dataset):
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return torch.full((2,), float(i), device="tpu").cpu()

        try:
            list(DataLoader(Data(), batch_size=2, num_workers=2))
            print("no error")
        except RuntimeError as e:
            print("raised", "forked subprocess" in str(e))
    """, timeout=120)
    assert out.strip().splitlines()[-1] == "raised True"


def test_child_forked_before_the_runtime_started_may_use_the_device():
    out = run_python("""
        import os, torch, torch_pjrt
        assert not torch.tpu.is_initialized()
        pid = os.fork()
        if pid == 0:
            ok = not torch.tpu._is_in_bad_fork() and (torch.arange(3.0, device="tpu") * 2).cpu().tolist() == [0, 2, 4]
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print("child status", status)
    """, timeout=120)
    assert out.strip().splitlines()[-1] == "child status 0"
