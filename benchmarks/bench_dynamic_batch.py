"""Dynamic batch sizes under torch.compile(backend="tpu", dynamic=True): batch buckets vs exact sizes.

GPT inference (benchmarks/gpt_model.py: 4 layers, width 256, sequence 32) called with a stream of batch sizes,
each mode in a fresh process, printed side by side in one run:

- buckets (default): an inference graph that keeps its batch rows apart runs each size padded to the next power
  of two and cut back, so a new size inside a seen bucket compiles only its input's pad;
- exact (TORCH_PJRT_BATCH_BUCKETS=0): every new size compiles its own program.

Per mode: XLA compiles and compile seconds over the stream (every size new once), wall seconds of that cold pass,
and the warm per-call time (every size seen). The outputs are checked against PyTorch CPU eager.

    PYTHONPATH=python python benchmarks/bench_dynamic_batch.py
"""
import json
import os
import subprocess
import sys
import time

import torch

SIZES = [3, 5, 6, 7, 9, 11, 12, 13, 15, 17, 20, 24, 27, 31]


def measure():
    import torch_pjrt
    from torch_pjrt import _compile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt_model import GPT

    torch.manual_seed(0)
    cpu = GPT(seq=32).eval()
    dev = GPT(seq=32).eval().to("tpu")
    dev.load_state_dict(cpu.state_dict())
    compiled = torch.compile(dev, backend="tpu", dynamic=True)
    inputs = {n: torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(n)) for n in SIZES}
    worst = 0.0
    before = torch_pjrt.metrics()
    start = time.perf_counter()
    with torch.no_grad():
        for n in SIZES:
            out = compiled(inputs[n].to("tpu")).cpu()
            worst = max(worst, (out - cpu(inputs[n])).abs().max().item())
    cold = time.perf_counter() - start
    after = torch_pjrt.metrics()
    warm = []
    with torch.no_grad():
        for _ in range(3):
            for n in SIZES:
                t = time.perf_counter()
                compiled(inputs[n].to("tpu")).cpu()
                warm.append(time.perf_counter() - t)
    print(json.dumps({"compiles": after["compiles"] - before["compiles"],
                      "compile_s": after["compile_seconds"] - before["compile_seconds"], "cold_s": cold,
                      "warm_ms": sorted(warm)[len(warm) // 2] * 1e3, "bucketed": _compile._bucket_calls[0],
                      "max_abs_diff": worst}))


def main():
    if "--one" in sys.argv:
        return measure()
    print(f"GPT inference (4 layers, width 256, seq 32), torch.compile dynamic=True, batch sizes {SIZES}")
    print(f"{'mode':8s} {'compiles':>9s} {'compile s':>10s} {'cold s':>8s} {'warm ms/call':>13s} {'bucketed calls':>15s} "
          f"{'max |diff| vs cpu':>18s}")
    rows = {}
    for mode, flag in (("buckets", "1"), ("exact", "0")):
        env = dict(os.environ, TORCH_PJRT_BATCH_BUCKETS=flag)
        out = subprocess.run([sys.executable, __file__, "--one"], env=env, check=True, capture_output=True, text=True)
        r = rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{mode:8s} {r['compiles']:9d} {r['compile_s']:10.2f} {r['cold_s']:8.2f} {r['warm_ms']:13.2f} "
              f"{r['bucketed']:15d} {r['max_abs_diff']:18.2e}")
    b, e = rows["buckets"], rows["exact"]
    print(f"buckets vs exact: compile seconds {e['compile_s'] / max(b['compile_s'], 1e-9):.2f}x less, cold pass "
          f"{e['cold_s'] / b['cold_s']:.2f}x faster, warm call {b['warm_ms'] / e['warm_ms']:.2f}x the time")


if __name__ == "__main__":
    main()
