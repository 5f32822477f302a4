"""TorchTitan (0.3) on tpu, run as a user runs it: `torchrun ... -m torchtitan.train --module llama3 --config
llama3_debugmodel`, its Llama-3 debug model (6 layers, flex attention compiled by torch.compile), AdamW, its
tokenizer and c4_test loaders reading assets generated here (dist_scripts/titan_assets.py), against the same
torchtitan run on PyTorch's CPU (dist_scripts/titan_train.py --reference-cpu) from the same seed checkpoint:

- 2 processes, FSDP2: per-step losses equal the CPU's 2-process run; a DCP checkpoint at step 2, and a run resumed
  from it gives steps 3-4 exactly the losses of the run that never stopped;
- 2 processes, tensor parallel (DTensor) and 1 process with --compile.enable (torch.compile's Inductor routed to
  the `tpu` backend): per-step losses equal the CPU's 1-process run on the same global batch; the reported grad
  norm equals a float64 norm of the gradients read back to the host.

Every launch has a hard timeout. torchtitan's default SPMD backend ("spmd_types") needs a newer torch's FSDP2,
so the runs pass `--parallelism.spmd_backend partial_dtensor` (the same on CUDA with torch 2.13), and
`--training.mixed_precision_param float32` so that the comparison is float32 against float32.
See docs/torchtitan.md.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (make deps installs it)")
LAUNCH_TIMEOUT = 300  # seconds per launch (each takes 10-60 s on a 2-core machine); a hang ends here
pytestmark = [pytest.mark.modes_inside,  # each launch runs fused mode itself: once per `make test`
              pytest.mark.timeout(4 * LAUNCH_TIMEOUT + 60)]  # at most 3 launches and the fixture's seed launch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "dist_scripts")
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
STEPS = 4
LOSS_TOL = dict(rel=1e-5, abs=1e-6)  # float32 noise; the runs measured agree to ~1e-7

COMMON = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.seq_len", "64",
          "--training.steps", str(STEPS), "--debug.seed", "0", "--parallelism.spmd_backend", "partial_dtensor",
          "--training.mixed_precision_param", "float32", "--metrics.disable_color_printing"]


def _env(workdir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    env.update(TORCH_PJRT_MODE="fused", OMP_NUM_THREADS="1", HF_HOME=str(workdir / "hf"), HF_DATASETS_OFFLINE="1",
               TITAN_F64_NORM="1")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def titan(workdir, nproc, *args, cpu=False):
    """One torchtitan launch in workdir; returns {step: loss}, {step: grad_norm}, the float64 grad norms and rank
    0's torch_pjrt metrics."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(SCRIPTS, "titan_train.py"), *(["--reference-cpu"] if cpu else []), *COMMON, *args]
    proc = subprocess.run(cmd, cwd=workdir, env=_env(workdir), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-8000:]}"
    device = re.findall(r"^TITAN_DEVICE (\S+)", proc.stdout, re.M)
    assert device == ["cpu" if cpu else "tpu"] * nproc, out[-4000:]
    losses, norms = {}, {}
    for step, loss, norm in re.findall(r"^TITAN_LOSS step=(\d+) loss=(\S+) grad_norm=(\S+)", proc.stdout, re.M):
        losses[int(step)], norms[int(step)] = float(loss), float(norm)
    sq = {}  # step order: the k-th report of each rank belongs to the k-th logged step
    for rank, value in re.findall(r"^TITAN_F64_NORM_SQ rank=(\d+) (\S+)", proc.stdout, re.M):
        sq.setdefault(rank, []).append(float(value))
    f64 = [math.sqrt(sum(v)) for v in zip(*sq.values())]
    metrics = re.findall(r"^TITAN_METRICS rank=0 (.*)$", proc.stdout, re.M)
    return losses, norms, f64, (json.loads(metrics[0]) if metrics else None)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The generated assets where the debug config looks for them, and a seed checkpoint (step 0, written by the
    CPU reference) that every run starts from: tpu and CPU draw different random initial weights."""
    d = tmp_path_factory.mktemp("titan")
    subprocess.run([sys.executable, os.path.join(SCRIPTS, "titan_assets.py"), str(d)], check=True,
                   timeout=LAUNCH_TIMEOUT)
    titan(d, 1, "--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
          "--dump-folder", "seed", cpu=True)
    assert os.path.isdir(d / "seed" / "checkpoint" / "step-0")
    return d


def seeded(workdir):
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", str(workdir / "seed" / "checkpoint" / "step-0")]


def test_fsdp2_two_processes_equals_cpu_and_resumes(workdir):
    args = [*seeded(workdir), "--training.local_batch_size", "1", "--checkpoint.interval", "2"]
    cpu, _, _, _ = titan(workdir, 2, *args, "--dump-folder", "cpu_fsdp", cpu=True)
    tpu, norms, f64, metrics = titan(workdir, 2, *args, "--dump-folder", "tpu_fsdp")
    assert sorted(cpu) == sorted(tpu) == list(range(1, STEPS + 1)), (cpu, tpu)
    assert [tpu[s] for s in sorted(tpu)] == pytest.approx([cpu[s] for s in sorted(cpu)], **LOSS_TOL), (tpu, cpu)
    assert [norms[s] for s in sorted(norms)] == pytest.approx(f64, rel=1e-5), (norms, f64)
    assert metrics["dist_collectives_staged"] > 0, metrics  # the collectives went through tpu_dist
    assert metrics["cpu_fallbacks"] == {}, metrics  # every op of the step ran on the device

    checkpoints = workdir / "tpu_fsdp" / "checkpoint"
    assert sorted(os.listdir(checkpoints)) == ["step-2", "step-4"]
    shutil.rmtree(checkpoints / "step-4")  # as if the run had stopped after step 3's first try
    resumed, _, _, _ = titan(workdir, 2, *args, "--dump-folder", "tpu_fsdp")
    assert sorted(resumed) == [3, 4], resumed
    assert resumed == {3: tpu[3], 4: tpu[4]}  # exactly: the same programs on the restored state


def test_tensor_parallel_and_compile_equal_cpu(workdir):
    args = [*seeded(workdir), "--training.local_batch_size", "2"]
    cpu, _, _, _ = titan(workdir, 1, *args, "--dump-folder", "cpu_one", cpu=True)
    assert sorted(cpu) == list(range(1, STEPS + 1)), cpu
    want = [cpu[s] for s in sorted(cpu)]

    tp, tp_norms, _, tp_metrics = titan(workdir, 2, *args, "--parallelism.tensor_parallel_degree", "2",
                               "--parallelism.data_parallel_shard_degree", "1", "--dump-folder", "tpu_tp")
    assert [tp[s] for s in sorted(tp)] == pytest.approx(want, **LOSS_TOL), (tp, cpu)
    assert tp_metrics["cpu_fallbacks"] == {} and tp_metrics["dist_collectives_staged"] > 0, tp_metrics

    compiled, norms, f64, metrics = titan(workdir, 1, *args, "--compile.enable", "--dump-folder", "tpu_compiled")
    assert [compiled[s] for s in sorted(compiled)] == pytest.approx(want, **LOSS_TOL), (compiled, cpu)
    assert [norms[s] for s in sorted(norms)] == pytest.approx(f64, rel=1e-5), (norms, f64)
    assert [tp_norms[s] for s in sorted(tp_norms)] == pytest.approx(f64, rel=1e-5), (tp_norms, f64)
    # torchtitan compiles each block and the loss with the default (Inductor) backend: routed to `tpu`.
    assert metrics["routed_graphs"] > 2, metrics
    assert metrics["cpu_fallbacks"] == {}, metrics


def test_imports_without_triton_and_set_timeout():
    """torchtitan imports Triton for its CUDA expert-parallel kernels; without Triton torch_pjrt supplies that one
    module, whose kernels raise naming Triton; torch.distributed.set_timeout exists once torchtitan is imported."""
    code = r"""
import importlib.util, sys
import torch_pjrt, torch
import torchtitan.train
import torch.distributed as dist
assert callable(dist.set_timeout)
if importlib.util.find_spec("triton") is None:
    from torchtitan.distributed.minimal_async_ep import kernels
    assert kernels.__torch_pjrt_placeholder__
    try:
        kernels.copy_rows_to_peers_kernel()
    except RuntimeError as e:
        assert "Triton" in str(e), e
        print("PLACEHOLDER")
else:
    print("TRITON")
from torchtitan.tools.utils import device_type, device_module
print("DEVICE", device_type, device_module is torch.tpu)
"""
    env = _env_plain()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "PLACEHOLDER" in proc.stdout or "TRITON" in proc.stdout, proc.stdout
    assert "DEVICE tpu True" in proc.stdout, proc.stdout


def _env_plain():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    return env
