"""What keeping values on a failed runtime check costs a training step.

A failed check (a bad index) leaves every tensor the step writes unchanged
(docs/design/runtime-checks.md): a fused graph selects its writes of older
values on its checks, a program overwriting a tensor older than an unread
status reads the statuses first, and CPU step counts are saved before a step.
This prints, side by side in one run, the step time of the GPT of
gpt_model.py (embedding and cross-entropy: checked indices; AdamW) with that
protection off and on, alternating rounds, and the ratio. Two loops: one reads
the loss every step (no wait added), one every 8 steps (each program that
writes the parameters first reads the previous step's status).

    PYTHONPATH=python python benchmarks/bench_failed_checks.py [--quick]
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

import torch_pjrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_model import gpt_setup, gpt_small_batch_setup  # noqa: E402


def make_steps(setup, capturable, read_every):
    torch.manual_seed(0)
    model, x, y = setup("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=capturable)

    def steps(n):
        for k in range(n):
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
            loss.backward()
            opt.step()
            if (k + 1) % read_every == 0:
                loss.item()
        torch.tpu.synchronize()

    return steps


def timed(steps, keep, n):
    torch_pjrt._C._set_keep_values_on_failed_checks(keep)
    start = time.perf_counter()
    steps(n)
    return (time.perf_counter() - start) / n


def compare(setup, mode, capturable, read_every, rounds, per_round):
    """Median step times (s) with the protection off and on, alternating rounds on one model each, and the
    median of the rounds' on/off ratios (each pair ran back to back: slow drift of a shared machine cancels)."""
    with torch_pjrt.mode(mode):
        runs = {keep: make_steps(setup, capturable, read_every) for keep in (False, True)}
        for keep, steps in runs.items():  # compile both (Adam's first step differs from the next ones)
            timed(steps, keep, 2 * max(read_every, 2))
        times = {False: [], True: []}
        for _ in range(rounds):
            for keep in (False, True):
                times[keep].append(timed(runs[keep], keep, per_round))
    torch_pjrt._C._set_keep_values_on_failed_checks(True)
    ratios = sorted(on / off for off, on in zip(times[False], times[True]))
    return [sorted(times[k])[rounds // 2] for k in (False, True)] + [ratios[rounds // 2]]


def main():
    quick = "--quick" in sys.argv
    rounds = 3 if quick else 15
    configs = [
        ("GPT b4 s128", gpt_setup, "fused", 8),
        ("GPT b1 s16", gpt_small_batch_setup, "fused", 8),
        ("GPT b1 s16", gpt_small_batch_setup, "strict", 4),
    ]
    print(f"{'model':<12} {'mode':<7} {'capturable':<10} {'reads':<13} {'off ms':>8} {'on ms':>8} {'on/off':>7}")
    print("(off/on ms: medians over rounds; on/off: the median of each round's ratio)")
    for name, setup, mode, per_round in configs:
        for capturable in (True, False):
            for read_every in (1, 8):
                n = max(per_round, read_every)
                off, on, ratio = compare(setup, mode, capturable, read_every, rounds, n)
                reads = "every step" if read_every == 1 else f"every {read_every}"
                print(f"{name:<12} {mode:<7} {str(capturable):<10} {reads:<13} {off * 1e3:8.2f} {on * 1e3:8.2f} "
                      f"{ratio:7.3f}", flush=True)


if __name__ == "__main__":
    main()
