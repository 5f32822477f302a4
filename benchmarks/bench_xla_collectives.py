"""In-process XLA collectives (torch_pjrt._xla_collectives) across N devices of one process.

For each collective and size: the first call (compile included), then the
median steady time of --reps calls (each waited for), the bytes per call
(inputs summed over devices) and the effective bandwidth; a final line checks
that the steady calls compiled nothing. Also the thread-rank path:
run_in_threads with one all_reduce per step.

    TORCH_PJRT_CPU_DEVICES=4 PYTHONPATH=python python benchmarks/bench_xla_collectives.py [--sizes 1024 1048576]
"""
import argparse
import statistics
import time

import torch

import torch_pjrt
from torch_pjrt import _xla_collectives as xc


def timed(fn, reps):
    times = []
    for _ in range(reps):
        torch.tpu.synchronize()
        t = time.perf_counter()
        fn()
        torch.tpu.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 1 << 20], help="float32 elements per device")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    n = torch.tpu.device_count()
    print(f"{n} device(s), mode {torch_pjrt.get_mode()}")
    for size in args.sizes:
        size -= size % n  # reduce_scatter / all_to_all split dim 0 into n chunks
        ts = [torch.randn(size).to(f"tpu:{i}") for i in range(n)]
        cases = {
            "all_reduce": lambda: xc.all_reduce(ts),
            "all_gather": lambda: xc.all_gather(ts),
            "reduce_scatter": lambda: xc.reduce_scatter(ts),
            "all_to_all": lambda: xc.all_to_all(ts),
            "broadcast": lambda: xc.broadcast(ts),
            "permute(ring)": lambda: xc.collective_permute(ts, [(r, (r + 1) % n) for r in range(n)]),
        }
        for name, fn in cases.items():
            first = timed(fn, 1)
            before = torch_pjrt.metrics()
            steady = timed(fn, args.reps)
            after = torch_pjrt.metrics()
            calls = after["collectives_in_xla"] - before["collectives_in_xla"]
            nbytes = (after["collective_bytes"] - before["collective_bytes"]) // max(calls, 1)
            print(f"{name:15s} {size:>9d} elems: first {first * 1e3:8.2f} ms, steady {steady * 1e3:8.3f} ms, "
                  f"{nbytes} B/call, {nbytes / steady / 1e9:6.2f} GB/s, "
                  f"compiles in steady calls: {after['compiles'] - before['compiles']}")

    def step(rank):
        t = torch.ones(args.sizes[0], device=f"tpu:{rank}")
        start = time.perf_counter()
        for _ in range(args.reps):
            xc.rank_all_reduce(t, "avg")
        t.cpu()
        return time.perf_counter() - start

    xc.run_in_threads(step, n)  # compile
    per_step = max(xc.run_in_threads(step, n)) / args.reps
    print(f"thread ranks: rank_all_reduce of {args.sizes[0]} elems: {per_step * 1e3:.3f} ms per call")


if __name__ == "__main__":
    main()
