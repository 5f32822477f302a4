"""Compile-time benchmark: prints, side by side in one run,

1. ops per graph against compile seconds, our own lowering seconds and peak
   memory (RSS of a fresh process per size) for a chain of `x = x + 1` on a
   4-element tensor, lazy mode (one graph whatever its length), then a long
   chain in fused mode (cut into graphs by TORCH_PJRT_FUSION_LIMIT);
2. a Python loop over 1024 row slices (`x[i] += 1`), lazy and fused mode;
3. small programs: strict single-op programs (an MLP forward and backward)
   and the same model as one fused graph, compile seconds per program and
   run time per step, with XLA's default options (TORCH_PJRT_XLA_TUNING=0) and
   with ours (LLVM emitters; level 0 for small strict programs).

    PYTHONPATH=python python benchmarks/bench_compile.py [--sizes 100,500,...]
"""
import argparse
import json
import os
import subprocess
import sys
import textwrap

CHAIN = """
x = torch.zeros(4).to("tpu")
torch_pjrt.sync()
for i in range(N):
    x = x + 1
torch_pjrt.sync()
assert x.cpu()[0].item() == N
"""

ROWS = """
x = torch.zeros(N, 16).to("tpu")
torch_pjrt.sync()
for i in range(N):
    x[i] += 1
torch_pjrt.sync()
assert x.cpu().sum().item() == N * 16
"""

SMALL = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                            torch.nn.Linear(64, 10)).to("tpu")
data = torch.randn(8, 32).to("tpu")
def step():
    model.zero_grad()
    model(data).softmax(-1).sum().backward()
    torch_pjrt.sync()
    torch.tpu.synchronize()
step()
compiled = dict(torch_pjrt.metrics())
best = float("inf")
for _ in range(20):
    start = time.perf_counter()
    step()
    best = min(best, time.perf_counter() - start)
extra["step_ms"] = best * 1000
"""

RUNNER = """
import json, resource, time, torch, torch_pjrt
torch_pjrt.set_mode(MODE)
N = SIZE
extra = {}
torch.zeros(1).to("tpu").cpu()  # starts the plugin outside the timed part
torch_pjrt.reset_metrics()
start = time.perf_counter()
BODY
total = time.perf_counter() - start
m = compiled if "compiled" in dir() else torch_pjrt.metrics()
print(json.dumps(dict(total=total, compile=m["compile_seconds"], compiles=m["compiles"],
                      lowering=m["graph_lowering_seconds"], graphs=m["graphs"],
                      rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **extra)))
"""


def run(body, mode, size, env=None, timeout=900):
    code = RUNNER.replace("BODY", textwrap.dedent(body)).replace("MODE", repr(mode)).replace("SIZE", str(size))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def row(name, r):
    if "error" in r:
        return f"{name:<34} {r['error']}"
    return (f"{name:<34} {r['graphs']:>6} {r['compile']:>9.2f} {r['lowering']:>9.3f} {r['total']:>8.2f} "
            f"{r['rss_mb']:>8.0f}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,500,1000,2000,5000")
    parser.add_argument("--long", type=int, default=20000, help="a chain cut by the fusion limit (fused mode)")
    parser.add_argument("--rows", type=int, default=1024)
    args = parser.parse_args()
    print(f"{'case':<34} {'graphs':>6} {'compile_s':>9} {'lower_s':>9} {'total_s':>8} {'rss_MB':>8}")
    for n in [int(s) for s in args.sizes.split(",")]:
        print(row(f"chain of {n} ops (lazy)", run(CHAIN, "lazy", n)), flush=True)
    print(row(f"chain of {args.long} ops (fused)", run(CHAIN, "fused", args.long)), flush=True)
    for mode in ("lazy", "fused"):
        print(row(f"{args.rows} row slices x[i] += 1 ({mode})", run(ROWS, mode, args.rows)), flush=True)
    print()
    print(f"{'small programs':<34} {'compiles':>8} {'s/compile':>10} {'step_ms':>8}")
    for mode in ("strict", "fused"):
        for label, env in (("XLA defaults", {"TORCH_PJRT_XLA_TUNING": "0"}), ("tuned", {})):
            r = run(SMALL, mode, 0, env)
            if "error" in r:
                print(f"{mode + ', ' + label:<34} {r['error']}")
                continue
            per = r["compile"] / max(r["compiles"], 1)
            print(f"{mode + ', ' + label:<34} {r['compiles']:>8} {per:>10.3f} {r['step_ms']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
