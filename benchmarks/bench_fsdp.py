"""FSDP2 through tpu_dist on 1, 2 and 4 processes (torchrun, CPU plugin): step time, collectives per step, bytes
staged per step, collectives inside XLA programs vs staged through Gloo, and graphs (program runs) per step.

    PYTHONPATH=python python benchmarks/bench_fsdp.py [--procs 1,2,4] [--steps 10] [--width 256] [--blocks 4]

The model (meta-device init, to_empty(device="tpu")) is `blocks` residual MLP blocks, each its own
fully_shard group (reshard after forward), under a root group. Each process count is one torchrun launch of
this file in worker mode (bench_distributed.py measures DDP the same way). On a machine with fewer cores than
processes the step time measures the contention too.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def worker(args):
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch_pjrt

    dist.init_process_group(timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("tpu", (world,))
    w = args.width

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(w), nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    with torch.device("meta"):
        model = nn.Sequential(*[Block() for _ in range(args.blocks)], nn.Linear(w, 10))
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="tpu")
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, w).to("tpu"), torch.randint(0, 10, (32,)).to("tpu")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(3):  # compiles
        step()
    dist.barrier()
    torch_pjrt.reset_metrics()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    m = torch_pjrt.metrics()
    if rank == 0:
        n = args.steps
        print("BENCH " + json.dumps({
            "procs": world, "step_ms": 1000 * elapsed / n,
            "collectives_per_step": (m["dist_collectives_staged"] + m["dist_collectives_in_xla"]) / n,
            "staged_per_step": m["dist_collectives_staged"] / n, "in_xla_per_step": m["dist_collectives_in_xla"] / n,
            "bytes_to_host_per_step": m["dist_staged_bytes_to_host"] / n,
            "bytes_to_device_per_step": m["dist_staged_bytes_to_device"] / n,
            "graphs_per_step": (m["graphs"] or m["executions"]) / n, "compiles": m["compiles"],
            "params": sum(p.numel() for p in model.parameters()) * world}), flush=True)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"FSDP2, {args.blocks} MLP blocks of width {args.width}, batch 32 per process, {args.steps} timed steps, "
          f"mode {os.environ.get('TORCH_PJRT_MODE', 'fused')}")
    print(f"{'procs':>5} {'step ms':>9} {'coll/step':>9} {'staged':>7} {'in XLA':>7} {'B to host/step':>15} "
          f"{'B to dev/step':>14} {'programs/step':>13} {'compiles':>8}")
    for n in [int(p) for p in args.procs.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__,
               "--worker", f"--steps={args.steps}", f"--width={args.width}", f"--blocks={args.blocks}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = [l for l in out.stdout.splitlines() if l.startswith("BENCH ")]
        if out.returncode or not lines:
            print(f"{n:>5} failed (exit {out.returncode}): {out.stderr[-2000:]}")
            continue
        r = json.loads(lines[0][6:])
        print(f"{n:>5} {r['step_ms']:>9.1f} {r['collectives_per_step']:>9.1f} {r['staged_per_step']:>7.1f} "
              f"{r['in_xla_per_step']:>7.1f} {r['bytes_to_host_per_step']:>15.0f} {r['bytes_to_device_per_step']:>14.0f} "
              f"{r['graphs_per_step']:>13.1f} {r['compiles']:>8}")


if __name__ == "__main__":
    main()
