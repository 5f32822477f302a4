"""Memory maps per loaded program, and the bound that keeps them flat.

XLA:CPU maps a few memory regions (/proc/self/maps lines) per loaded
executable; a process may hold vm.max_map_count (65530). Before programs were
unloaded, ~17,000 distinct programs in one process crashed it in JIT code.
This runs N distinct programs per workload in a fresh process, once with no
practical bound (each program stays loaded) and once with a bound, and prints
the maps each adds:

    PYTHONPATH=python python benchmarks/bench_program_maps.py [--programs 300] [--bound 50]

`--programs 18000 --bound 1000000000 --workloads ops` reproduces the old crash (slow: about 20 minutes).
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, torch, torch_pjrt

workload, programs = sys.argv[1], int(sys.argv[2])


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def ops(n):  # strict mode: a program per op, one new shape per step (two programs: fill, add)
    (torch.ones(n, device="tpu") + 1).cpu()


def graph(n):  # fused mode: an MLP training step per batch size (forward + backward + update graphs)
    torch.manual_seed(0)
    w = torch.randn(16, 8, device="tpu", requires_grad=True)
    x = torch.randn(n, 16, device="tpu")
    (x @ w).relu().square().mean().backward()
    with torch.no_grad():
        w -= 0.1 * w.grad
    w.cpu()


run = {"ops": ops, "graph": graph}[workload]
run(1)  # the plugin's one-time maps
torch.tpu.synchronize()
start_maps, start_compiles, t = maps(), torch_pjrt.metrics()["compiles"], time.time()
n = 2
while torch_pjrt.metrics()["compiles"] - start_compiles < programs:
    run(n)
    n += 1
torch.tpu.synchronize()
m = torch_pjrt.metrics()
print(json.dumps({"compiles": m["compiles"] - start_compiles, "maps_added": maps() - start_maps,
                  "loaded": m["programs_loaded"], "unloaded": m["programs_unloaded"],
                  "seconds": time.time() - t}))
"""


def measure(workload, programs, bound):
    mode = "strict" if workload == "ops" else "fused"
    env = dict(os.environ, TORCH_PJRT_MODE=mode, TORCH_PJRT_MAX_LOADED_PROGRAMS=str(bound),
               PYTHONPATH=os.pathsep.join(sys.path))
    env["TORCH_PJRT_CACHE_DIR"] = ""  # memory only: reloads compile
    out = subprocess.run([sys.executable, "-c", CHILD, workload, str(programs)], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        return {"error": f"exit code {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=300)
    p.add_argument("--bound", type=int, default=50)
    p.add_argument("--workloads", default="ops,graph")
    args = p.parse_args()
    print(f"{'workload':8} {'bound':>10} {'compiles':>8} {'maps added':>10} {'per program':>11} {'loaded':>6} "
          f"{'unloaded':>8} {'seconds':>7}")
    for workload in args.workloads.split(","):
        for bound in (10**9, args.bound):
            r = measure(workload, args.programs, bound)
            if "error" in r:
                print(f"{workload:8} {bound:>10} {r['error']}")
                continue
            print(f"{workload:8} {bound:>10} {r['compiles']:>8} {r['maps_added']:>10} "
                  f"{r['maps_added'] / r['compiles']:>11.2f} {r['loaded']:>6} {r['unloaded']:>8} "
                  f"{r['seconds']:>7.1f}")


if __name__ == "__main__":
    main()
