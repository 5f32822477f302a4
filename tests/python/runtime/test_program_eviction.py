"""The bound on loaded programs (TORCH_PJRT_MAX_LOADED_PROGRAMS).

XLA:CPU maps a few memory regions per loaded executable, so a process that
kept every program it compiled crashed past vm.max_map_count (~17,000
programs). Each test runs a subprocess with a small bound over a few hundred
distinct programs (op plans in strict mode, fused graphs, a torch.compile
replay, a jax_op) and revisits the early ones: results equal the CPU's, the
loaded count never exceeds the bound, revisits reload, and /proc/self/maps
stays flat once the bound is reached.
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.modes_inside

BOUND = 20

SCRIPT = r"""
import json, os, sys, torch, torch_pjrt

SHAPES = int(sys.argv[1])
FLOOD = int(sys.argv[2])  # new shapes enough to unload everything loaded before them
peak = peak_maps = 0


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def note():
    global peak, peak_maps
    m = torch_pjrt.metrics()
    peak = max(peak, m["programs_loaded"])
    peak_maps = max(peak_maps, m["program_maps"])
    return m


def step(n):
    # A distinct shape: new programs (strict: one per op; fused: one graph).
    x = torch.linspace(-2, 2, n)
    expected = (x * 0.5 + n).sin() * x
    actual = ((x.to("tpu") * 0.5 + n).sin() * x.to("tpu")).cpu()
    torch.testing.assert_close(actual, expected)
    note()


first = torch_pjrt.metrics()["compiles"]
for n in range(1, SHAPES // 2 + 1):
    step(n)
torch.tpu.synchronize()
flat_from, compiles_from = maps(), torch_pjrt.metrics()["compiles"]
for n in range(SHAPES // 2 + 1, SHAPES + 1):
    step(n)
torch.tpu.synchronize()
grown, compiled_meanwhile = maps() - flat_from, torch_pjrt.metrics()["compiles"] - compiles_from
alive_after_sync = torch_pjrt.metrics()["executables_alive"]
reloaded_before = torch_pjrt.metrics()["programs_reloaded"]
for n in range(1, 11):  # the earliest programs, long unloaded
    step(n)

# torch.compile: its replay plan holds a fused program, unloaded by the flood below.
def f(a, b):
    return (a @ b).relu() + 1

fc = torch.compile(f, backend="tpu", dynamic=False)
a, b = torch.randn(5, 7), torch.randn(7, 3)
for _ in range(3):
    torch.testing.assert_close(fc(a.to("tpu"), b.to("tpu")).cpu(), f(a, b))
for n in range(SHAPES + 1, SHAPES + 1 + FLOOD):
    step(n)
replays = torch_pjrt.metrics()["compiled_replays"]
reloaded = torch_pjrt.metrics()["programs_reloaded"]
torch.testing.assert_close(fc(a.to("tpu"), b.to("tpu")).cpu(), f(a, b))
m = note()
compiled_reloaded = m["programs_reloaded"] - reloaded
compiled_replayed = m["compiled_replays"] - replays

jax_ok = None
try:
    import jax
except ImportError:
    pass
else:
    @torch_pjrt.jax_op("evict_test::cube")
    def cube(x):
        return x * x * x
    for n in (3, 4):
        x = torch.randn(n)
        torch.testing.assert_close(cube(x.to("tpu")).cpu(), x * x * x)
    for n in range(SHAPES + 1 + FLOOD, SHAPES + 1 + 2 * FLOOD):
        step(n)
    x = torch.randn(3)
    torch.testing.assert_close(cube(x.to("tpu")).cpu(), x * x * x)
    jax_ok = True

torch.tpu.synchronize()
m = note()
print(json.dumps({
    "peak": peak, "loaded": m["programs_loaded"], "alive_after_sync": alive_after_sync,
    "max_loaded": m["max_loaded_programs"], "peak_maps": peak_maps, "max_maps": m["max_loaded_maps"], "compiles": m["compiles"] - first,
    "unloaded": m["programs_unloaded"], "reloaded_revisit": m["programs_reloaded"] - reloaded_before,
    "maps_grown": grown, "compiled_meanwhile": compiled_meanwhile,
    "compiled_reloaded": compiled_reloaded, "compiled_replayed": compiled_replayed, "jax": jax_ok,
}))
"""


def run(mode, shapes, bound=BOUND, maps=None, flood=2 * BOUND):
    env = dict(os.environ, TORCH_PJRT_MODE=mode, TORCH_PJRT_MAX_LOADED_PROGRAMS=str(bound),
               PYTHONPATH=os.pathsep.join(sys.path))
    if maps:
        env["TORCH_PJRT_MAX_LOADED_MAPS"] = str(maps)
    env["TORCH_PJRT_CACHE_DIR"] = ""  # reloads compile: the memory tier alone is under test
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(shapes), str(flood)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode,shapes", [("strict", 60), ("fused", 160)])
def test_bounded_programs_give_cpu_results_and_reload(mode, shapes):
    r = run(mode, shapes)
    assert r["max_loaded"] == BOUND
    assert r["compiles"] >= 150, r  # a few hundred programs with the reloads, far past the bound
    assert r["peak"] <= BOUND and r["loaded"] <= BOUND, r
    assert r["alive_after_sync"] <= BOUND, r  # nothing else keeps an unloaded executable
    assert r["unloaded"] >= r["compiles"] - BOUND - 5, r
    assert r["reloaded_revisit"] >= 10, r  # each early shape's programs were unloaded and came back
    # Past the bound, new programs replace unloaded ones: an unbounded process
    # grows ~3 maps per program (the ctest measures it), here nearly nothing.
    assert r["compiled_meanwhile"] >= 50, r
    assert r["maps_grown"] < 40, r
    # The torch.compile graph still replays after its program was unloaded.
    assert r["compiled_replayed"] == 1 and r["compiled_reloaded"] >= 1, r
    assert r["jax"] in (True, None)


def test_bad_bound_is_refused():
    env = dict(os.environ, TORCH_PJRT_MAX_LOADED_PROGRAMS="0", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", "import torch, torch_pjrt; torch.ones(2, device='tpu') + 1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "TORCH_PJRT_MAX_LOADED_PROGRAMS must be a positive integer" in out.stderr


def test_maps_budget_bounds_fused_graphs():
    # A fused graph maps 3 regions per JIT object (several per graph): the
    # budget on maps binds before the (here unreachable) program count.
    maps = 150
    r = run("fused", 120, bound=100000, maps=maps, flood=60)
    assert r["max_maps"] == maps and r["max_loaded"] == 100000
    assert r["peak_maps"] <= maps, r
    assert 3 <= r["peak"] < r["compiles"] // 2, r  # far fewer programs loaded than compiled
    assert r["reloaded_revisit"] >= 10, r
    assert r["compiled_meanwhile"] >= 50 and r["maps_grown"] < 60, r
    assert r["compiled_replayed"] == 1 and r["compiled_reloaded"] >= 1, r
