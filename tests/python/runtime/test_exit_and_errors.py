"""Interpreter exit with daemon threads using the device, and what errors leave behind.

Exit: CPython 3.11 ends a daemon thread that takes the GIL back after
finalization began with pthread_exit; its unwind through torch's noexcept GIL
guard was std::terminate ("terminate called without an active exception",
status 134) on every run of these scripts (csrc/bindings/interpreter_exit.cpp).
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

MODES = ("strict", "fused")

# Daemon threads inside every kind of device call when the main thread returns:
# ops, autograd (its own device threads), reads, pinned and plain uploads. They
# sync often: in fused mode an unsynced loop would grow one 2000-op graph.
_DAEMONS_AT_EXIT = """
import sys, threading, torch, torch_pjrt
x = torch.randn(128, 128, device="tpu")
def matmuls():
    y = x
    while True:
        y = (y @ x).tanh()
        torch_pjrt.sync()
def backward():
    w = torch.randn(128, 128, device="tpu", requires_grad=True)
    while True:
        (x @ w).relu().sum().backward()
        torch_pjrt.sync()
def reads():
    while True:
        (x * 2).sum().item()
        (x + 1).cpu()
def uploads():
    src = torch.randn(1 << 14).pin_memory()
    while True:
        src.to("tpu", non_blocking=True)
        torch.randn(1 << 10).to("tpu")
        torch.tpu.synchronize()
threads = [threading.Thread(target=f, daemon=True) for f in (matmuls, backward, reads, uploads)]
for t in threads:
    t.start()
z = (x @ x).sum()
print("ok", float(z) == float(z), flush=True)
sys.exit(int(sys.argv[1]))
"""


def _run(script, mode, *args, timeout=180):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TORCH_PJRT_MODE=mode)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.mark.modes_inside  # its subprocesses pick their mode: once per `make test`
@pytest.mark.parametrize("mode", MODES)
def test_daemon_threads_in_device_calls_do_not_crash_the_exit(mode):
    for status in (0, 0, 0, 3):  # the script's own exit status survives
        proc = _run(_DAEMONS_AT_EXIT, mode, str(status))
        assert "ok True" in proc.stdout, proc.stderr[-3000:]
        assert "terminate" not in proc.stderr, proc.stderr[-3000:]
        assert proc.returncode == status, proc.stderr[-3000:]


# A compiled AdamW step donates every parameter and state; their spent handles are destroyed on a background thread
# (release_spent). Exiting with batches still queued, and with work in flight, leaves the exit status alone, and the
# parameters read before the exit equal the same steps on the CPU.
_SPENT_BUFFERS_AT_EXIT = """
import sys, torch, torch_pjrt
def train(device, steps):
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)]).to(device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, capturable=device == "tpu")
    step = torch.compile(opt.step, backend="tpu") if device == "tpu" else opt.step
    x = torch.randn(4, 8).to(device)
    for _ in range(steps):
        opt.zero_grad()
        m(x).square().sum().backward()
        step()
    return m
ref, got = train("cpu", 5), train("tpu", 5)
close = all(torch.allclose(a, b.cpu(), rtol=1e-4, atol=1e-5) for a, b in zip(ref.parameters(), got.parameters()))
print("ok", close, flush=True)
for _ in range(3):  # more donations queued, then exit without waiting
    got(torch.randn(4, 8, device="tpu")).sum().backward()
    torch_pjrt.sync()
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.modes_inside  # its subprocesses pick their mode: once per `make test`
@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_spent_buffers_queued_at_exit(mode):
    proc = _run(_SPENT_BUFFERS_AT_EXIT, mode, "5")  # the script's own status, not 0 by accident
    assert "ok True" in proc.stdout, proc.stderr[-3000:]
    assert "terminate" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 5, proc.stderr[-3000:]


# Without torch_pjrt the same script with CPU tensors dies as well (a torch +
# CPython 3.11 defect): importing torch_pjrt fixes it for CPU work too.
_CPU_DAEMON_AT_EXIT = """
import threading, torch, torch_pjrt
x = torch.randn(256, 256)
def matmuls():
    y = x
    while True:
        y = (y @ x).tanh()
for _ in range(2):
    threading.Thread(target=matmuls, daemon=True).start()
z = (x @ x).sum()
print("ok", float(z) == float(z), flush=True)
"""


@pytest.mark.modes_inside  # its subprocesses pick their mode: once per `make test`
def test_cpu_daemon_threads_do_not_crash_the_exit():
    for _ in range(3):
        proc = _run(_CPU_DAEMON_AT_EXIT, "strict")
        assert proc.returncode == 0 and "terminate" not in proc.stderr, proc.stderr[-3000:]
        assert "ok True" in proc.stdout


# A daemon thread blocked in Python (not in a device call) must not delay the
# exit: our atexit hook waits only for threads inside device calls. A hook
# registered before torch_pjrt's runs after it (atexit is last in, first out).
_IDLE_DAEMON_AT_EXIT = """
import atexit, threading, time
marks = {}
atexit.register(lambda: print("atexit took %.3f s" % (time.monotonic() - marks["end"]), flush=True))
import torch, torch_pjrt
x = torch.ones(4, device="tpu")
threading.Thread(target=lambda: time.sleep(1000), daemon=True).start()
print("ok", float(x.sum()) == 4.0, flush=True)
marks["end"] = time.monotonic()
"""


@pytest.mark.modes_inside  # its subprocesses pick their mode: once per `make test`
def test_idle_daemon_thread_does_not_delay_the_exit():
    proc = _run(_IDLE_DAEMON_AT_EXIT, "fused")
    assert proc.returncode == 0 and "ok True" in proc.stdout, proc.stderr[-3000:]
    took = float(proc.stdout.split("atexit took ")[1].split()[0])
    assert took < 1.0, proc.stdout  # the wait for threads inside device calls ends when none is inside


# ------------------------------------------------ a failed index check's writes
# What a program whose runtime index check failed leaves behind
# (docs/design/runtime-checks.md): the error comes at the next wait, and a tensor
# that had a value keeps it: none of the op's updates is written, in-range or not,
# never one clamped onto another element. (The CPU raises partway through its loop:
# the elements before the bad index are written there.) The device keeps working
# and reports the error once.
import torch  # noqa: E402

import torch_pjrt  # noqa: E402
from conftest import DEVICE  # noqa: E402


def _write(op, x, idx, src):
    if op == "index_put_":
        return x.index_put_((idx,), src)
    if op == "scatter_":
        return x.scatter_(0, idx, src)
    return x.index_copy_(0, idx, src)


@pytest.mark.parametrize("op", ["index_put_", "scatter_", "index_copy_"])
def test_failed_index_check_writes_nothing(op):
    idx = [0, 1, 9, 3]
    src = torch.tensor([1.0, 2.0, 3.0, 4.0])
    before = torch.arange(6.0)
    x = before.to(DEVICE)
    torch_pjrt.sync()  # x has its value before the op's program or graph
    with pytest.raises((IndexError, RuntimeError), match="out of"):
        _write(op, x, torch.tensor(idx, device=DEVICE), src.to(DEVICE))
        x.cpu()  # the next wait, in modes that do not wait at the op
    torch.testing.assert_close(x.cpu(), before, rtol=0, atol=0)
    # Reported once, and the device goes on.
    torch.testing.assert_close((x + 1).cpu(), before + 1)
    keep = [i for i, j in enumerate(idx) if j < 6]
    _write(op, x, torch.tensor([idx[i] for i in keep], device=DEVICE), src[keep].to(DEVICE))
    torch.testing.assert_close(x.cpu(), _write(op, before.clone(), torch.tensor([idx[i] for i in keep]), src[keep]))
