"""Fused/lazy benchmark: prints, side by side in one run,

1. training step time of an MLP and of a small GPT-style transformer
   (4 layers, width 256, batch 4, sequence 128, AdamW) in strict, fused and
   lazy mode against PyTorch CPU eager; the GPT again at batch 1, sequence 16,
   where per-op host cost dominates (as on a GPU or TPU);
2. time to the first training step in a fresh process with a cold and with a
   warm persistent compile cache (TORCH_PJRT_CACHE_DIR), fused mode.

    PYTHONPATH=python python benchmarks/bench_fused.py
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import torch_pjrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# The models live in gpt_model.py (no torch_pjrt import: bench_gpu.py's CUDA
# reference process uses them); re-exported here for the other benchmarks.
from gpt_model import GPT, Block, gpt_setup, gpt_small_batch_setup, mlp_setup, training_step  # noqa: E402,F401


def step_time(setup, device, mode, steps):
    with torch_pjrt.mode(mode):
        step = training_step(setup, device)
        for _ in range(2):  # compile
            step()
        times = []  # the median step: a 2-core machine has noisy neighbours
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]


def check_reads_per_step(setup):
    """Runtime index checks cost one tiny status read per graph at the step's loss.item()."""
    with torch_pjrt.mode("fused"):
        torch.manual_seed(0)
        model, x, y = setup("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = torch_pjrt.metrics()["check_status_reads"]
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
            opt.step()
            torch.tpu.synchronize()
        return (torch_pjrt.metrics()["check_status_reads"] - before) / 3


FIRST_STEP = """
import time, torch, torch_pjrt, sys
# PyTorch's optimizer imports torch._dynamo (about 1.5 s, sympy included) on
# any device; paid before the clock, since no cache can change it.
import torch._dynamo
sys.path.insert(0, {bench_dir!r})
from bench_fused import gpt_setup
import torch.nn.functional as F
start = time.perf_counter()
torch.manual_seed(0)
model, x, y = gpt_setup("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
loss.backward(); opt.step(); loss.item()
m = torch_pjrt.metrics()
print(time.perf_counter() - start, m["compiles"], m["disk_cache_hits"], m["compile_seconds"],
      m["disk_cache_load_seconds"])
"""


def first_step_seconds(cache_dir):
    """(seconds to the first step, compiles, disk hits, compile s, disk load s) in a new process."""
    env = dict(os.environ, TORCH_PJRT_CACHE_DIR=cache_dir, TORCH_PJRT_MODE="fused",
               PYTHONPATH=os.pathsep.join(sys.path))
    code = FIRST_STEP.format(bench_dir=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    seconds, compiles, hits, compile_s, load_s = out.stdout.split()
    return float(seconds), int(compiles), int(hits), float(compile_s), float(load_s)


def record_cost():
    """Host time per op when ops are only recorded (lazy mode, warm caches)."""
    a = torch.randn(4, 4, device="tpu")
    with torch_pjrt.mode("lazy"):
        for _ in range(2):
            start = time.perf_counter()
            b = a
            for _ in range(500):
                b = b + 1.0
            recorded = time.perf_counter() - start
            torch_pjrt.sync()
            b.cpu()
    eager_cpu = a.cpu()
    start = time.perf_counter()
    c = eager_cpu
    for _ in range(500):
        c = c + 1.0
    cpu = time.perf_counter() - start
    print(f"== host cost per op: recorded {recorded / 500 * 1e6:.1f} us, CPU eager {cpu / 500 * 1e6:.1f} us ==")


def main():
    print("platform:", torch_pjrt.platform())
    record_cost()
    times_by_model = {}
    models = [("MLP", mlp_setup, 30), ("GPT 4x256, batch 4, seq 128", gpt_setup, 7),
              ("GPT 4x256, batch 1, seq 16 (host-bound)", gpt_small_batch_setup, 15)]
    for name, setup, steps in models:
        print(f"\n== {name}: training step (forward, backward, AdamW) ==")
        cpu = step_time(setup, "cpu", "strict", steps)
        print(f"{'cpu eager':12s} {cpu * 1e3:9.1f} ms/step")
        times = times_by_model[name] = {}
        for mode in ("strict", "fused", "lazy"):
            times[mode] = step_time(setup, "tpu", mode, steps)
            print(f"{'tpu ' + mode:12s} {times[mode] * 1e3:9.1f} ms/step  {cpu / times[mode]:5.2f}x cpu eager")
        print(f"fused vs strict: {times['strict'] / times['fused']:.2f}x faster")
        if setup is gpt_setup:
            print(f"index checks: {check_reads_per_step(setup)} device-side check statuses read per fused step "
                  "(embedding and cross-entropy indices; one per graph)")
    print("\n== time to the first GPT training step in a new process (fused mode) ==")
    with tempfile.TemporaryDirectory() as cache_dir:
        cold, cold_compiles, _, cold_compile_s, _ = first_step_seconds(cache_dir)
        warm, warm_compiles, warm_hits, _, warm_load_s = first_step_seconds(cache_dir)
    step = times_by_model["GPT 4x256, batch 4, seq 128"]["fused"]
    print(f"cold cache {cold:7.2f} s ({cold_compiles} compiles taking {cold_compile_s:.2f} s)")
    print(f"warm cache {warm:7.2f} s ({warm_compiles} compiles, {warm_hits} loaded from disk taking "
          f"{warm_load_s:.2f} s; one steady fused step is {step:.2f} s)")
    print(f"warm start: {cold / warm:.1f}x faster to the first step")


if __name__ == "__main__":
    main()
