"""torch.distributed on tpu tensors across processes: the tpu_dist backend (staged through Gloo on the CPU plugin).

Each test launches a few processes (torchrun, or plain subprocesses where a rank must fail) running a script
from tests/python/distributed/dist_scripts/, which checks many things per launch against Gloo on CPU tensors or one CPU
process, and prints RESULT lines. Every launch has a hard timeout. The scripts pick their execution modes
(TORCH_PJRT_MODE per launch), so `make test` runs this file once.
"""
import os
import re
import subprocess
import signal
import sys
import time

import pytest
import torch
import torch.distributed as dist

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # tests/python/<layer>/ -> repo
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts")
LAUNCH_TIMEOUT_S = 240  # the machine may be heavily loaded; a hang still ends here


def _env(mode, **extra):
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    env["TORCH_PJRT_MODE"] = mode
    env["OMP_NUM_THREADS"] = "1"
    return env


def torchrun(script, nproc, *args, mode="fused", **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(SCRIPTS, script), *args]
    proc = subprocess.run(cmd, env=_env(mode, **env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    results = re.findall(r"RESULT rank=\d+ [^\n]*", proc.stdout)
    assert proc.returncode == 0 and len(results) == nproc, f"exit {proc.returncode}\n{out[-6000:]}"
    return results


def test_registered_as_the_tpu_backend():
    assert "tpu_dist" in dist.Backend.backend_list
    assert dist.get_default_backend_for_device("tpu") == "tpu_dist"
    assert dist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.Backend.backend_capability["tpu_dist"] == ["tpu", "cpu"]
    assert "dist_collectives_staged" in torch_pjrt.metrics()


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_every_collective_2_processes_strict_default_backend():
    results = torchrun("collectives.py", 2, "default", mode="strict")
    assert all("failures=0" in r for r in results), results


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_every_collective_4_processes_fused_tpu_dist():
    results = torchrun("collectives.py", 4, "tpu_dist", mode="fused")
    assert all("failures=0" in r for r in results), results


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_every_collective_1_process_stays_on_the_device():
    results = torchrun("collectives.py", 1, "tpu_dist", mode="fused")
    assert all("failures=0" in r for r in results), results


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_ddp_matches_one_process_on_the_global_batch():
    results = torchrun("ddp_train.py", 2, "--backend", "cpu:gloo,tpu:tpu_dist", mode="fused")
    assert all("failures=0" in r for r in results), results


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_mpmd_rank0_evaluates_and_checkpoints(tmp_path):
    results = torchrun("ddp_train.py", 2, "--mpmd", "--bucket-views", "--checkpoint-dir", str(tmp_path),
                       mode="strict")
    assert all("failures=0" in r for r in results), results
    assert sorted(os.listdir(tmp_path)) == ["step2.pt", "step5.pt", "step8.pt"]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("per_process", ["1", "2"])
def test_torchrun_local_rank_picks_the_device(per_process):
    results = torchrun("local_device.py", 2, mode="fused", TORCH_PJRT_CPU_DEVICES=per_process)
    assert all("failures=0" in r for r in results), results


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_device_mesh_2d_splits_groups_and_dtensor_4_processes():
    results = torchrun("device_mesh.py", 4, mode="fused")
    assert all("failures=0" in r for r in results), results


def _launch_failing_ranks(tmp_path, mode, timeout_s):
    """Rank 0's exit status and output. A rank 0 that has not exited within LAUNCH_TIMEOUT_S is asked for its
    threads' stacks (faulthandler, SIGUSR1) before it is killed, so a hang (at exit or before) names its place."""
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, os.path.join(SCRIPTS, "failing_rank.py"), str(r), "2", str(store),
                               str(timeout_s), mode], env=_env("fused"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        try:
            out0, _ = procs[0].communicate(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            procs[0].send_signal(signal.SIGUSR1)
            time.sleep(5)
            procs[0].kill()
            out0, _ = procs[0].communicate()
            pytest.fail(f"rank 0 did not exit within {LAUNCH_TIMEOUT_S} s; its output and stacks:\n{out0[-12000:]}")
        return procs[0].returncode, out0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_a_rank_that_raises_stops_the_others_with_a_clear_error(tmp_path):
    rc, out = _launch_failing_ranks(tmp_path, "raise", 15)
    error = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert rc == 3 and error, out[-4000:]
    assert "all_reduce" in error[0] and "rank 1" in error[0], error[0]
    _assert_refused_after(out)


def _assert_refused_after(out):
    """After a failed collective the group raises at once, naming the failure, for every later collective."""
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert refused, out[-4000:]
    assert "earlier collective" in refused[0] and "collective #2" in refused[0], refused[0]
    assert float(refused[0].split("after ")[1].split("s:")[0]) < 5, refused[0]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_a_stalled_rank_times_out_with_a_clear_error(tmp_path):
    rc, out = _launch_failing_ranks(tmp_path, "stall", 6)
    error = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert rc == 3 and error, out[-4000:]
    assert "all_reduce" in error[0] and "not reached by rank 1" in error[0] and "timeout 6 s" in error[0], error[0]
    waited = float(error[0].split("after ")[1].split("s:")[0])
    assert 5 <= waited < 60, error[0]
    _assert_refused_after(out)
