"""accelerate and the HF Trainer on tpu (torch_pjrt/_accelerate.py): data-parallel under torchrun and
`accelerate launch` with the script unchanged, the losses and parameters of one process on the global batch;
a tpu process left non-distributed under WORLD_SIZE > 1 raises; bf16, fp16 and the `tpu` compile backend.

The launches run dist_scripts/hf_train.py (2 processes, a tiny model, 4 steps), each under a hard
timeout; they pick their execution mode, so `make test` runs this file once.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import torch_pjrt

pytest.importorskip("accelerate")
pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # tests/python/<layer>/ -> repo
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_scripts", "hf_train.py")
LAUNCH_TIMEOUT_S = 240  # the machine may be heavily loaded; a hang still ends here


def _env(tmp_path, mode="fused"):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    env["TORCH_PJRT_MODE"] = mode
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HOME"] = str(tmp_path / "hf")  # no accelerate config file of the machine's
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd, env, nproc):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT rank=")]
    assert proc.returncode == 0 and len(results) == nproc, f"exit {proc.returncode}\n{out[-6000:]}"
    assert all("failures=0" in r for r in results), out[-6000:]
    return results


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 30)
def test_trainer_torchrun_2_processes_equals_1_process_compiled(tmp_path):
    """torchrun --nproc-per-node 2 with Trainer(torch_compile_backend='tpu'): DDP over tpu_dist, and the logged
    losses and final parameters of one (uncompiled) process on the global batch."""
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    results = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", SCRIPT,
                    "--api", "trainer", "--compile", "--out", str(two)], _env(tmp_path), 2)
    assert all("type=MULTI_GPU processes=2 device=tpu:0" in r for r in results), results
    _run([sys.executable, SCRIPT, "--api", "trainer", "--out", str(one)], _env(tmp_path), 1)
    two, one = json.loads(two.read_text()), json.loads(one.read_text())
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for name, value in one["params"].items():
        torch.testing.assert_close(torch.tensor(two["params"][name]), torch.tensor(value), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_accelerate_launch_num_processes_2_is_data_parallel(tmp_path):
    """`accelerate launch --num_processes 2` with one visible tpu device runs 2 processes (accelerate alone would run
    one), each in DDP, matching one CPU process on the global batch (checked in the script). The launcher process
    imports torch_pjrt first, as `import torch` does when torch_pjrt is installed."""
    launcher = ("import sys, torch_pjrt; from accelerate.commands.launch import main; "
                "sys.argv[0] = 'accelerate-launch'; main()")
    results = _run([sys.executable, "-c", launcher, "--num_processes", "2", "--main_process_port", "0", SCRIPT,
                    "--api", "accelerate"], _env(tmp_path, mode="strict"), 2)
    assert all("type=MULTI_GPU processes=2" in r for r in results), results


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_accelerate_imported_first_and_world_size_without_launcher_raises(tmp_path):
    """accelerate imported before torch_pjrt is adapted too; a tpu process with WORLD_SIZE=2 but no LOCAL_RANK
    (not started by torchrun) raises instead of training alone."""
    code = """
import accelerate.state
from accelerate.utils.constants import TORCH_DISTRIBUTED_BACKENDS
import torch_pjrt
from accelerate import PartialState
from accelerate.utils import DistributedType
assert TORCH_DISTRIBUTED_BACKENDS["tpu"] == "tpu_dist", TORCH_DISTRIBUTED_BACKENDS
assert DistributedType("MULTI_TPU") is DistributedType.MULTI_GPU
try:
    PartialState()
except RuntimeError as e:
    print("RAISED", e)
else:
    print("TRAINS ALONE")
"""
    env = _env(tmp_path)
    env.update(WORLD_SIZE="2", RANK="0")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "RAISED torch_pjrt: this process was launched as one of WORLD_SIZE=2" in proc.stdout, proc.stdout
    assert "torchrun" in proc.stdout


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_tables_know_tpu(fresh_accelerate_state):
    from accelerate.utils import DistributedType, DynamoBackend, TorchDynamoPlugin
    from accelerate.utils.imports import get_distributed_backend

    assert get_distributed_backend("tpu") == "tpu_dist"
    assert DistributedType("MULTI_TPU") is DistributedType.MULTI_GPU
    assert DynamoBackend("TPU") is DynamoBackend.TPU and DynamoBackend.TPU in list(DynamoBackend)
    assert TorchDynamoPlugin(backend="tpu").to_kwargs()["backend"] == "tpu"


def test_compile_backend_tpu_through_accelerate(fresh_accelerate_state):
    from accelerate import Accelerator
    from accelerate.utils import TorchDynamoPlugin

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    want = model(x)
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="tpu"))
    compiled = accelerator.prepare_model(model)
    assert hasattr(compiled, "_orig_mod")
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), want, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_precision_matches_cpu_autocast(fresh_accelerate_state):
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x).float()
    full = model(x).detach()
    accelerator = Accelerator(mixed_precision="bf16")
    assert accelerator.native_amp
    prepared = accelerator.prepare_model(model)
    got = prepared(x.to("tpu"))
    assert got.dtype == torch.float32  # accelerate's convert_outputs_to_fp32, as on the CPU
    torch.testing.assert_close(got.cpu(), want, rtol=1e-2, atol=1e-2)
    # bf16 really ran: differs from the float32 result by bf16 rounding, as the CPU's does
    assert not torch.equal(got.cpu(), full)


def test_fp16_mixed_precision_fails_with_the_fix(fresh_accelerate_state, tmp_path):
    from accelerate import Accelerator

    with pytest.raises(ValueError, match=r"refuses fp16 .*Use bf16 .*GradScaler\('tpu'\)"):
        Accelerator(mixed_precision="fp16")
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), fp16=True, report_to="none")
    with pytest.raises(ValueError, match=r"refuses fp16 .*TrainingArguments\(bf16=True\)"):
        transformers.Trainer(model=torch.nn.Linear(2, 2), args=args)
