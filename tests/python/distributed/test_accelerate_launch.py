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
import tomllib

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


def _installed(tmp_path, env):
    """env as after `pip install`: torch_pjrt's entry points (pyproject.toml) on the path, so that `import torch`
    loads it wherever that happens first, in the launcher too (there inside accelerate's own import)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        groups = tomllib.load(f)["project"]["entry-points"]
    info = tmp_path / "site" / "torch_pjrt-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_pjrt\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
        for group, entries in groups.items()))
    env["PYTHONPATH"] = os.pathsep.join([str(info.parent), env["PYTHONPATH"]])
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    return env


def _run(cmd, env, nproc):
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT rank=")]
    assert proc.returncode == 0 and len(results) == nproc, f"exit {proc.returncode}\n{out[-6000:]}"
    assert all("failures=0" in r for r in results), out[-6000:]
    assert "could not adapt" not in out, out[-6000:]
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
def test_python_m_accelerate_launch_num_processes_2_is_data_parallel_and_compiled(tmp_path):
    """`python -m accelerate.commands.launch --num_processes 2 --dynamo_backend tpu` with one visible tpu device
    and torch_pjrt installed runs 2 processes (accelerate alone would run one; as __main__ the launcher is no
    module import), each in DDP on its own tpu:0 and compiled by the `tpu` backend, matching one CPU process on
    the global batch (checked in the script). The script begins with accelerate, so torch_pjrt loads in the middle
    of accelerate's import, in the launcher and in both ranks, and must adapt it all the same."""
    env = _installed(tmp_path, _env(tmp_path, mode="strict"))
    results = _run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                    "--main_process_port", "0", "--dynamo_backend", "tpu", SCRIPT,
                    "--api", "accelerate", "--accelerate-first", "--compile"], env, 2)
    assert all("type=MULTI_GPU processes=2 device=tpu:0" in r for r in results), results


CLI_PROBE = """
import sys
import accelerate.commands.launch as launch
from accelerate import Accelerator, PartialState
from accelerate.commands.accelerate_cli import main

assert "torch_pjrt" in sys.modules, "accelerate's import torch did not load torch_pjrt"
patched = (Accelerator.__init__, Accelerator.prepare_model, PartialState.__init__, PartialState.set_device)
print("PATCHED", all(getattr(f, "_torch_pjrt_wrapped", False) for f in patched))
launch.multi_gpu_launcher = lambda args: print("LAUNCH multi_gpu", args.num_processes, args.dynamo_backend)
launch.simple_launcher = lambda args: print("LAUNCH one process")
sys.argv = ["accelerate", "launch", "--num_processes", "2", "--dynamo_backend", "tpu", "train.py"]
main()
"""


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_accelerate_cli_launch_picks_multi_process_and_takes_dynamo_backend_tpu(tmp_path):
    """The `accelerate launch` console script's path (accelerate_cli.main), torch_pjrt installed and so loaded in
    the middle of accelerate's import: every class patched without a warning, `--dynamo_backend tpu` accepted,
    and `--num_processes 2` taken to the multi-process launcher (stubbed: nothing is started)."""
    env = _installed(tmp_path, _env(tmp_path))
    proc = subprocess.run([sys.executable, "-c", CLI_PROBE], env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "could not adapt" not in out, out[-4000:]
    assert "PATCHED True" in proc.stdout, out[-4000:]
    assert "LAUNCH multi_gpu 2 tpu" in proc.stdout, out[-4000:]


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
