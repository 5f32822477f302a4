"""Asynchronous copies: host time a copy takes to return, side by side in one run.

1. device -> host into pinned memory: `out.copy_(x, non_blocking=True)` returns once the read is launched, while
   the programs computing x still run; a blocking `.cpu()` returns after them. Also the total time to the value
   (launch, then synchronize) for both, and the same with pageable memory (always a synchronous read).
2. host -> device from pinned memory, non_blocking vs blocking.

    PYTHONPATH=python python benchmarks/bench_streams.py
"""
import time

import torch

import torch_pjrt  # noqa: F401


def slow_result(n=768, rounds=16):
    x = torch.rand(n, n, generator=torch.Generator().manual_seed(1)).to("tpu")
    for _ in range(rounds):
        x = torch.tanh(x @ x / n)
    return x


def timed(fn, repeats=5):
    """Median (host seconds until fn returns, seconds until its value is there) over `repeats` runs."""
    returned, complete = [], []
    for _ in range(repeats):
        torch.tpu.synchronize()
        start = time.perf_counter()
        fn()
        returned.append(time.perf_counter() - start)
        torch.tpu.synchronize()
        complete.append(time.perf_counter() - start)
    return sorted(returned)[len(returned) // 2], sorted(complete)[len(complete) // 2]


def main():
    slow_result()  # compile outside the timings
    torch.tpu.synchronize()
    pinned = torch.empty(768, 768).pin_memory()
    pageable = torch.empty(768, 768)
    rows = [
        ("D2H non_blocking, pinned", lambda: pinned.copy_(slow_result(), non_blocking=True)),
        ("D2H blocking (.cpu())", lambda: slow_result().cpu()),
        ("D2H non_blocking, pageable", lambda: pageable.copy_(slow_result(), non_blocking=True)),
    ]
    results = {name: timed(fn) for name, fn in rows}
    print(f"{'copy (after 16 matmuls of 768x768 on tpu)':44s} {'returns (ms)':>13s} {'value (ms)':>11s}")
    for name, (ret, done) in results.items():
        print(f"{name:44s} {ret * 1e3:13.2f} {done * 1e3:11.2f}")
    base = results["D2H blocking (.cpu())"][0]
    print(f"host time returned, blocking / non_blocking pinned: {base / results['D2H non_blocking, pinned'][0]:.0f}x")

    big = torch.rand(64 << 20 >> 2)  # 64 MiB
    big_pinned = big.pin_memory()
    up = {"H2D non_blocking, pinned": timed(lambda: big_pinned.to("tpu", non_blocking=True)),
          "H2D blocking, pageable": timed(lambda: big.to("tpu"))}
    print(f"{'upload of 64 MiB':44s} {'returns (ms)':>13s} {'value (ms)':>11s}")
    for name, (ret, done) in up.items():
        print(f"{name:44s} {ret * 1e3:13.2f} {done * 1e3:11.2f}")


if __name__ == "__main__":
    main()
