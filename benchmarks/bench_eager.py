"""Eager-mode benchmark: prints ratios measured side by side in one run.

1. Per-op host overhead: a tiny op (warm cache) in strict mode, and recorded
   then run as one graph per 300 calls in fused mode, against PyTorch CPU
   eager on the same tensors.
2. One MLP training step (forward, backward, AdamW) in debug, strict and
   fused mode against PyTorch CPU eager.

    PYTHONPATH=python python benchmarks/bench_eager.py
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt


def per_call_seconds(fn, sync, repeat=300):
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def op_overhead():
    print("== per-op host overhead, tiny tensors (4x4), warm cache ==")
    print(f"{'op':12s} {'cpu eager':>12s} {'tpu strict':>12s} {'tpu fused':>12s} {'strict/cpu':>11s}")
    for name, fn in [("add", lambda a, b: a + b), ("mul_", lambda a, b: a.mul_(1.0)),
                     ("matmul", lambda a, b: a @ b), ("sum", lambda a, b: a.sum()),
                     ("relu", lambda a, b: torch.relu(a))]:
        times = {}
        for device, mode in (("cpu", "strict"), ("tpu", "strict"), ("tpu", "fused")):
            with torch_pjrt.mode(mode):
                a, b = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
                sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
                times[device + " " + mode] = per_call_seconds(lambda: fn(a, b), sync)
        cpu, strict, fused = times["cpu strict"], times["tpu strict"], times["tpu fused"]
        print(f"{name:12s} {cpu * 1e6:10.1f}us {strict * 1e6:10.1f}us {fused * 1e6:10.1f}us {strict / cpu:10.1f}x")


def mlp_step_time(device, mode, steps=20):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256, device=device)
    y = torch.randint(0, 10, (64,), device=device)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    with torch_pjrt.mode(mode):
        for _ in range(3):  # compile
            step()
        if device == "tpu":
            torch.tpu.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        loss.item()
        return (time.perf_counter() - start) / steps


def mlp():
    print("\n== MLP training step (256-512-512-10, batch 64, AdamW) ==")
    cpu = mlp_step_time("cpu", "strict")
    print(f"{'cpu eager':12s} {cpu * 1e3:8.2f} ms/step   1.00x")
    for mode in ("debug", "strict", "fused"):
        t = mlp_step_time("tpu", mode)
        print(f"{'tpu ' + mode:12s} {t * 1e3:8.2f} ms/step {t / cpu:6.2f}x cpu eager")


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    print("platform:", torch_pjrt.platform())
    op_overhead()
    mlp()
    print("\n" + torch_pjrt.metrics_report())
