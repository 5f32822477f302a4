"""FSDP2, DTensor tensor parallel, the 2-D mesh and distributed checkpoints on tpu tensors.

Each launch (dist_scripts/fsdp_train.py) spawns 2 or 4 processes on the
tpu_dist backend, runs several cases and writes every rank's results; the tests
compare them with one process on the global batch on the CPU
(fsdp_models.reference): 10 AdamW steps, same losses and parameters within
float32 tolerance. Few launches, many checks per launch, each under a hard
subprocess timeout (the collectives' own timeout is shorter, so a hang
surfaces as an error naming the collective).
"""
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "dist_scripts")
sys.path.insert(0, SCRIPTS)
import fsdp_models as M  # noqa: E402
from fsdp_train import GLOBAL_BATCH  # noqa: E402

pytestmark = [pytest.mark.modes_inside,  # each launch picks its mode: once per `make test`
              pytest.mark.timeout(1300)]  # a test may set up both launches (-k): 2 x LAUNCH_TIMEOUT + checks

LAUNCH_TIMEOUT = 600  # seconds, per launch (a launch takes ~1 minute on an idle 2-core machine)
TOL = dict(rtol=1e-4, atol=1e-5)


def launch(tmp_path_factory, name, nproc, cases, mode, **extra_env):
    out = tmp_path_factory.mktemp(name)
    env = dict(os.environ, TORCH_PJRT_MODE=mode, FSDP_TEST_COLLECTIVE_TIMEOUT="240", **extra_env,
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "..", "..", "python"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "fsdp_train.py"), str(out), str(nproc), ",".join(cases)],
                       capture_output=True, text=True, env=env, timeout=LAUNCH_TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return out, [torch.load(out / f"rank{k}.pt") for k in range(nproc)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """2 processes, fused mode: FSDP2, TP on an MLP and on attention, checkpoints."""
    return launch(tmp_path_factory, "two", 2, ["fsdp", "tp_mlp", "tp_attn", "dcp"], "fused")


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    """4 processes, strict mode: FSDP2 + TP on a 2x2 mesh, FSDP2 over 4, loading the 2-process checkpoint."""
    return launch(tmp_path_factory, "four", 4, ["fsdp_tp", "fsdp", "dcp_reshard"], "strict",
                  FSDP_TEST_CHECKPOINT=str(two[0] / "dcp"))


def check_params(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name, **TOL)


def check_data_parallel(results, kind, dp_of):
    """Losses: each dp group's average is the global batch's loss (equal batch slices); parameters equal."""
    losses, params = M.reference(kind, GLOBAL_BATCH)
    by_dp = {}
    for r in results:
        by_dp.setdefault(dp_of(r), []).append(r["losses"])
    for group in by_dp.values():  # the ranks of one dp group (tensor parallel) saw the same batch slice
        for same in group:
            torch.testing.assert_close(torch.tensor(same), torch.tensor(group[0]), **TOL)
    mean = torch.tensor([group[0] for group in by_dp.values()]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(losses), **TOL)
    for r in results:
        check_params(r["params"], params)


@pytest.mark.parametrize("launch_name", ["two", "four"])
def test_fsdp2_matches_one_process(launch_name, request):
    _, results = request.getfixturevalue(launch_name)
    fsdp = [r["fsdp"] for r in results]
    check_data_parallel([dict(f, rank=k) for k, f in enumerate(fsdp)], "mlp", lambda r: r["rank"])
    for f in fsdp:  # reshard after forward: the unsharded storages are freed, and were there while it ran
        assert f["reshard"]["after"] and all(n == 0 for n in f["reshard"]["after"])
        assert all(n > 0 for n in f["reshard"]["during"])


@pytest.mark.parametrize("case,kind", [("tp_mlp", "mlp"), ("tp_attn", "attn")])
def test_tensor_parallel_matches_one_process(two, case, kind):
    _, results = two
    losses, params = M.reference(kind, GLOBAL_BATCH)
    for r in results:  # every rank sees the whole batch
        torch.testing.assert_close(torch.tensor(r[case]["losses"]), torch.tensor(losses), **TOL)
        check_params(r[case]["params"], params)


def test_fsdp_tp_2d_mesh_matches_one_process(four):
    _, results = four
    check_data_parallel([r["fsdp_tp"] for r in results], "attn", lambda r: r["dp_rank"])


@pytest.mark.parametrize("launch_name,case", [("two", "fsdp"), ("four", "fsdp"), ("four", "fsdp_tp")])
def test_steady_steps_compile_nothing(launch_name, case, request):
    """After step 2 a step compiles nothing and runs the same programs and collectives."""
    _, results = request.getfixturevalue(launch_name)
    for r in results:
        steps = r[case]["per_step"]  # per step: compiles, graphs, executions, staged collectives
        assert len(steps) == M.STEPS and steps[0][3] > 0
        assert all(s[0] == 0 for s in steps[2:]), steps
        assert all(s[1:] == steps[2][1:] for s in steps[2:]), steps


def test_no_cpu_fallback_and_staged_collectives(two, four):
    for _, results in (two, four):
        for r in results:
            assert r["cpu_fallbacks"] == {}
            assert r["dist"]["dist_collectives_staged"] > 0


def test_dcp_save_load_sharded_state(two):
    _, results = two
    for r in results:
        d = r["dcp"]
        assert d["differed_before"], "the fresh model must start different, or the check proves nothing"
        assert d["mismatch"] == []
        assert d["n_opt_states"] == 3 * len(d["params"])  # AdamW: step, exp_avg, exp_avg_sq per parameter
        check_params(d["fresh_params"], d["params"])
    check_params(results[0]["dcp"]["params"], M.reference("mlp", GLOBAL_BATCH)[1])


def test_dcp_load_with_another_world_size(two, four):
    """Saved sharded over 2 processes, loaded sharded over 4: the same full model and optimizer state."""
    saved = two[1][0]["dcp"]
    assert len(saved["full_optim"]) == 3 * len(saved["params"])  # rank 0 holds the full optimizer state
    for r in four[1]:
        check_params(r["dcp_reshard"]["params"], saved["params"])
    got, want = four[1][0]["dcp_reshard"]["full_optim"], saved["full_optim"]
    assert got.keys() == want.keys()
    for key in want:
        assert torch.as_tensor(got[key]).device.type == "cpu"
        torch.testing.assert_close(torch.as_tensor(got[key]), torch.as_tensor(want[key]), rtol=0, atol=0, msg=key)


LOAD_WITHOUT_PLUGIN = r"""
import sys, torch
sd = torch.load(sys.argv[1])
assert "torch_pjrt" not in sys.modules, "torch_pjrt was imported"
bad = {k: str(v.device) for k, v in sd.items() if not (isinstance(v, torch.Tensor) and v.device.type == "cpu")}
assert not bad, bad
torch.save(sd, sys.argv[2])
print("loaded", len(sd))
"""


def test_full_state_dict_loads_without_the_plugin(two, tmp_path):
    out, results = two
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # even if torch_pjrt were installed
    copy = tmp_path / "copy.pt"
    r = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PLUGIN, str(out / "full_state.pt"), str(copy)],
                       capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-3000:]
    check_params(torch.load(copy), results[0]["dcp"]["params"])
