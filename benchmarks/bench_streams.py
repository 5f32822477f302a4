"""Asynchronous copies: host time a copy takes to return, side by side in one run.

1. device -> host into pinned memory: `out.copy_(x, non_blocking=True)` returns once the read is launched, while
   the programs computing x still run; a blocking `.cpu()` returns after them. Also the total time to the value
   (launch, then synchronize) for both, and the same with pageable memory (always a synchronous read).
2. host -> device from pinned memory, non_blocking vs blocking.
3. device -> device (tpu:0 -> tpu:1, two CPU-plugin devices): the plugin's copy vs a round trip through the
   host, time and bytes each way (torch_pjrt.metrics()).

    PYTHONPATH=python python benchmarks/bench_streams.py
"""
import os
import time

os.environ.setdefault("TORCH_PJRT_CPU_DEVICES", "2")  # before the runtime starts: section 3 needs two devices

import torch

import torch_pjrt


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

    if torch.tpu.device_count() < 2:
        return
    on0 = big.to("tpu:0")
    keys = ("device_to_device_bytes", "device_to_host_bytes", "host_to_device_bytes")
    moves = {}
    for name, fn in (("D2D tpu:0 -> tpu:1, plugin copy", lambda: on0.to("tpu:1")),
                     ("D2D tpu:0 -> tpu:1, through the host", lambda: on0.cpu().to("tpu:1"))):
        before = torch_pjrt.metrics()
        fn()
        torch.tpu.synchronize()
        after = torch_pjrt.metrics()
        moves[name] = (timed(fn), {k: after[k] - before[k] for k in keys})
    print(f"{'copy of 64 MiB between devices':44s} {'returns (ms)':>13s} {'value (ms)':>11s}  bytes moved (MiB)")
    for name, ((ret, done), moved) in moves.items():
        where = ", ".join(f"{k.replace('_bytes', '')} {v / 2**20:.0f}" for k, v in moved.items() if v)
        print(f"{name:44s} {ret * 1e3:13.2f} {done * 1e3:11.2f}  {where}")
    plugin, host = (moves[n][0][1] for n in moves)
    print(f"time to the value, through the host / plugin copy: {host / plugin:.1f}x")


if __name__ == "__main__":
    main()
