"""Host->device copies: how long `.to("tpu")` holds the caller, and whether a
non_blocking copy from pinned memory overlaps with device work.

Prints, for a float32 tensor of --mb megabytes (median of --reps runs):
1. the call time of a blocking copy from pageable memory, and of a
   non_blocking copy from pinned memory (it returns before the transfer ends),
   then the time until torch.tpu.synchronize() returns;
2. a chain of matmuls on the device alone, the copy alone, and both, with the
   copy blocking (pageable) and non_blocking (pinned);
3. the same with host work (a CPU matmul chain, as a loader preparing the
   next batch) instead of device work.

    PYTHONPATH=python TORCH_PJRT_MODE=strict python benchmarks/bench_pinned.py [--mb 256]
"""
import argparse
import statistics
import time

import torch

import torch_pjrt  # noqa: F401


def timed(fn, reps):
    times = []
    for _ in range(reps):
        torch.tpu.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    src = torch.ones(args.mb * 1024 * 1024 // 4)
    pinned = src.pin_memory()
    a = torch.randn(1024, 1024).to("tpu")

    def compute():
        y = a
        for _ in range(8):
            y = y @ a
        return y

    def synced(fn):
        def run():
            fn()
            torch.tpu.synchronize()
        return run

    blocking_call = timed(lambda: src.to("tpu"), args.reps)
    async_call = timed(lambda: pinned.to("tpu", non_blocking=True), args.reps)
    async_total = timed(synced(lambda: pinned.to("tpu", non_blocking=True)), args.reps)
    print(f"{args.mb} MB: blocking .to('tpu') returns after {blocking_call:.1f} ms; "
          f"pinned non_blocking returns after {async_call:.1f} ms, synchronized after {async_total:.1f} ms")
    compute_only = timed(synced(compute), args.reps)
    copy_only = timed(synced(lambda: src.to("tpu")), args.reps)
    both_blocking = timed(synced(lambda: (compute(), src.to("tpu"))), args.reps)
    both_async = timed(synced(lambda: (compute(), pinned.to("tpu", non_blocking=True))), args.reps)
    print(f"device matmul chain {compute_only:.0f} ms, copy {copy_only:.0f} ms; together: blocking copy "
          f"{both_blocking:.0f} ms, pinned non_blocking copy {both_async:.0f} ms")
    h = torch.randn(512, 512)

    def host_work():
        y = h
        for _ in range(8):
            y = y @ h
        return y

    host_only = timed(host_work, args.reps)
    host_blocking = timed(synced(lambda: (src.to("tpu"), host_work())), args.reps)
    host_async = timed(synced(lambda: (pinned.to("tpu", non_blocking=True), host_work())), args.reps)
    print(f"host matmul chain {host_only:.0f} ms; copy then host work: blocking copy {host_blocking:.0f} ms, "
          f"pinned non_blocking copy {host_async:.0f} ms")


if __name__ == "__main__":
    main()
