"""Training step time with and without torch_pjrt.DeviceLoader.

A DataLoader makes batches of --mb megabytes on the host (a CPU transform of
--prep matmuls per batch, as decoding or augmentation would); each step runs an
MLP forward/backward and an SGD step on the device and reads the loss. The plain
loop copies each batch with .to("tpu") when it needs it; DeviceLoader prepares and
uploads the next --prefetch batches on its thread while the step runs.
Prints ms per step (median over --steps after --warmup) and the time the loop
waited for its next batch.

    PYTHONPATH=python python benchmarks/bench_device_loader.py [--mb 16] [--workers 0]
"""
import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset

import torch_pjrt


class HostBatches(Dataset):
    def __init__(self, n, rows, cols, prep):
        self.n, self.rows, self.cols, self.prep = n, rows, cols, prep
        self.weight = torch.randn(cols, cols) / cols ** 0.5

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.rows, self.cols, generator=g)
        for _ in range(self.prep):  # host-side preprocessing
            x = torch.tanh(x @ self.weight)
        return x, torch.randint(0, 10, (self.rows,), generator=g)


def run(batches, model, optimizer, to_device, warmup):
    step_times, waits = [], []
    it = iter(batches)
    t_last = time.perf_counter()
    for step in range(len(batches)):
        t_wait = time.perf_counter()
        x, y = to_device(next(it))
        waited = time.perf_counter() - t_wait
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loss.item()
        now = time.perf_counter()
        if step >= warmup:
            step_times.append(now - t_last)
            waits.append(waited)
        t_last = now
    return statistics.median(step_times) * 1e3, statistics.median(waits) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=16)
    parser.add_argument("--cols", type=int, default=512)
    parser.add_argument("--prep", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--prefetch", type=int, default=2)
    args = parser.parse_args()
    rows = max(1, int(args.mb * 1024 * 1024 / 4 / args.cols))
    data = HostBatches(args.steps + args.warmup, rows, args.cols, args.prep)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.cols, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10)).to("tpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def loader():
        kwargs = dict(multiprocessing_context="fork") if args.workers else {}
        return DataLoader(data, batch_size=None, num_workers=args.workers, **kwargs)

    def plain_copy(batch):
        return tuple(t.to("tpu") for t in batch)

    print(f"batch {rows}x{args.cols} float32 ({args.mb} MB), {args.prep} host matmuls per batch, "
          f"MLP {args.cols}-{args.hidden}-10, workers={args.workers}, mode={torch_pjrt.get_mode()}")
    for name, batches, to_device in [
        ("plain .to('tpu')", loader(), plain_copy),
        (f"DeviceLoader(prefetch={args.prefetch})", torch_pjrt.DeviceLoader(loader(), prefetch=args.prefetch),
         lambda b: b),
    ]:
        step_ms, wait_ms = run(batches, model, optimizer, to_device, args.warmup)
        print(f"{name:28s} {step_ms:8.1f} ms/step, waiting for the batch {wait_ms:7.1f} ms")


if __name__ == "__main__":
    main()
