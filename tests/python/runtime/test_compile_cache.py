"""The persistent compile cache, across processes sharing one directory.
Every program, an op's (strict, debug) or a graph's (fused, lazy), goes through the one compile cache and its
disk tier, so the subprocesses run in the surrounding (fused) pass's mode and `make test` runs this file once;
the warm start is checked with both kinds of programs."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.modes_inside  # one pass: the disk tier is the same code for every mode's programs

SCRIPT = r"""
import json, torch, torch_pjrt
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to("tpu")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(4, 8).to("tpu")
for _ in range(2):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
value = loss.item()  # runs any recorded graph before the counters are read
m = torch_pjrt.metrics()
print(json.dumps({"loss": value, "compiles": m["compiles"], "hits": m["disk_cache_hits"],
                  "writes": m["disk_cache_writes"], "corrupt": m["disk_cache_corrupt"]}))
"""


def run(cache_dir, extra_env=None, background=False, script=SCRIPT):
    env = dict(os.environ, TORCH_PJRT_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join(sys.path))
    env.update(extra_env or {})
    args = [sys.executable, "-c", script]
    if background:
        return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = subprocess.run(args, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def entries(cache_dir):
    return [p for p in cache_dir.iterdir() if p.suffix == ".xla"]


@pytest.mark.parametrize("mode", ["fused", "strict"])  # graph programs, one program per op
def test_warm_start_compiles_nothing(tmp_path, mode):
    cold = run(tmp_path, {"TORCH_PJRT_MODE": mode})
    assert cold["compiles"] > 0 and cold["writes"] == cold["compiles"]
    warm = run(tmp_path, {"TORCH_PJRT_MODE": mode})
    assert warm["compiles"] == 0
    assert warm["hits"] == cold["compiles"]
    assert warm["loss"] == cold["loss"]


def test_the_same_program_from_other_lines_compiles_nothing(tmp_path):
    # Each op's location (its user line) is in the program text, but not in
    # the cache key: the same steps recorded three lines further down load.
    cold = run(tmp_path)
    moved = run(tmp_path, script="\n\n\n" + SCRIPT)
    assert cold["compiles"] > 0
    assert moved["compiles"] == 0 and moved["hits"] == cold["compiles"]
    assert moved["loss"] == cold["loss"]


def test_two_processes_fill_one_directory(tmp_path):
    procs = [run(tmp_path, background=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["loss"] == results[1]["loss"]
    assert not list(tmp_path.glob("*.tmp")), "no temporary files left behind"
    after = run(tmp_path)
    assert after["compiles"] == 0 and after["corrupt"] == 0


def test_corrupt_entries_are_rebuilt(tmp_path):
    cold = run(tmp_path)
    files = entries(tmp_path)
    for i, f in enumerate(files):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if i % 2 else data[:-8] + b"garbage!")
    again = run(tmp_path)
    assert again["loss"] == cold["loss"]
    assert again["corrupt"] == len(files) and again["compiles"] == len(files)
    assert run(tmp_path)["compiles"] == 0


def test_other_plugin_version_misses(tmp_path):
    run(tmp_path)
    # Rewrite each entry's identity line as if another plugin version built it.
    for f in entries(tmp_path):
        magic, identity, rest = f.read_bytes().split(b"\n", 2)
        f.write_bytes(b"\n".join([magic, identity + b" (other build)", rest]))
    other = run(tmp_path)
    assert other["compiles"] > 0 and other["hits"] == 0


def test_unwritable_directory_does_not_break_the_program(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = run(blocker / "cache")
    assert result["compiles"] > 0 and result["writes"] == 0


def test_on_by_default_in_the_user_cache_directory(tmp_path):
    """No TORCH_PJRT_CACHE_DIR: $XDG_CACHE_HOME/torch_pjrt (else ~/.cache/torch_pjrt); empty turns it off."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_PJRT_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))

    def run_default(**extra):
        out = subprocess.run([sys.executable, "-c", SCRIPT], env=dict(env, **extra), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold = run_default()
    assert cold["compiles"] > 0 and cold["writes"] == cold["compiles"]
    assert len(entries(tmp_path / "torch_pjrt")) == cold["compiles"]
    warm = run_default()
    assert warm["compiles"] == 0 and warm["hits"] == cold["compiles"] and warm["loss"] == cold["loss"]
    off = run_default(TORCH_PJRT_CACHE_DIR="")
    assert off["compiles"] == cold["compiles"] and off["hits"] == 0 and off["writes"] == 0
