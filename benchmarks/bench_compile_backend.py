"""torch.compile(backend="tpu") benchmark: the GPT training step of bench_fused.py
(4 layers, width 256, batch 4, sequence 128, AdamW) compiled vs fused vs strict vs
PyTorch CPU eager, side by side in one run; then the same at batch 1, sequence 16
(host-bound), and the XLA programs per compiled step.

Compiled step: forward + loss under torch.compile (one forward program), its
AOTAutograd backward (one program), and torch.compile(opt.step) of a capturable
AdamW (one program); after the first calls each is replayed (no op dispatch).

    PYTHONPATH=python python benchmarks/bench_compile_backend.py
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

import torch_pjrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused import gpt_setup, gpt_small_batch_setup, step_time  # noqa: E402


def compiled_step_time(setup, steps):
    torch._dynamo.reset()
    with torch_pjrt.mode("fused"):
        torch.manual_seed(0)
        model, x, y = setup("tpu")
        # capturable: the step counts live on the device, so the compiled
        # step's graph has only tpu inputs and replays (CPU step counts would
        # make it run op by op on every call).
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

        @torch.compile(backend="tpu")
        def loss_of(x, y):
            return F.cross_entropy(model(x).flatten(0, -2), y.flatten())

        opt_step = torch.compile(opt.step, backend="tpu")

        def step():
            opt.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            opt_step()
            return loss.item()

        for _ in range(3):  # compile (the first AdamW step differs from later ones)
            step()
        before = torch_pjrt.metrics()
        step()
        after = torch_pjrt.metrics()
        programs = after["executions"] - before["executions"]
        replays = after["compiled_replays"] - before["compiled_replays"]
        times, host = [], []
        for _ in range(steps):
            start = time.perf_counter()
            opt.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            opt_step()
            dispatched = time.perf_counter()  # the programs are enqueued, not finished
            loss.item()
            end = time.perf_counter()
            times.append(end - start)
            host.append(dispatched - start)
        median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        return median(times), median(host), programs, replays


def main():
    print("platform:", torch_pjrt.platform())
    for name, setup, steps in [("GPT 4x256, batch 4, seq 128", gpt_setup, 7),
                               ("GPT 4x256, batch 1, seq 16 (host-bound)", gpt_small_batch_setup, 15)]:
        print(f"\n== {name}: training step (forward, backward, AdamW) ==")
        cpu = step_time(setup, "cpu", "strict", steps)
        print(f"{'cpu eager':14s} {cpu * 1e3:9.1f} ms/step")
        times = {}
        for mode in ("strict", "fused"):
            times[mode] = step_time(setup, "tpu", mode, steps)
            print(f"{'tpu ' + mode:14s} {times[mode] * 1e3:9.1f} ms/step  {cpu / times[mode]:5.2f}x cpu eager")
        compiled, host, programs, replays = compiled_step_time(setup, steps)
        print(f"{'tpu compiled':14s} {compiled * 1e3:9.1f} ms/step  {cpu / compiled:5.2f}x cpu eager  "
              f"({programs} XLA programs per step, {replays} of them replayed; {host * 1e3:.1f} ms until all "
              "are enqueued: on the CPU plugin this includes running them)")
        print(f"compiled vs fused: {times['fused'] / compiled:.2f}x faster; vs strict: "
              f"{times['strict'] / compiled:.2f}x faster")


if __name__ == "__main__":
    main()
