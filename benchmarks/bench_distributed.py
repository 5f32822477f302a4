"""Data parallel training through torch_pjrt's collectives: step time, collectives per step, bytes moved per
step, and how many collectives ran inside XLA programs vs staged through Gloo.

    PYTHONPATH=python python benchmarks/bench_distributed.py [--setups ddp,fsdp2,devices] [--procs 1,2,4]
        [--steps 10] [--width 256] [--blocks 4]

- ddp: DistributedDataParallel over tpu_dist, one torchrun process per rank (CPU plugin: staged through Gloo).
- fsdp2: fully_shard per residual MLP block (meta-device init, to_empty(device="tpu")), one torchrun launch per
  process count, same path.
- devices: N devices in ONE process (TORCH_PJRT_CPU_DEVICES=N): a replica per device, gradients averaged by one
  XLA all_reduce program over the devices (torch_pjrt._xla_collectives), no host staging.
Every setup trains the same model: `blocks` residual MLP blocks of width `width` and a 10-way head, batch 32 per
rank, AdamW. On a machine with fewer cores than ranks the step time measures the contention too.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def build_model(width, blocks):
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(self.up(self.norm(x)).relu())

    return nn.Sequential(*[Block() for _ in range(blocks)], nn.Linear(width, 10))


def timed_steps(step, steps, barrier):
    """Runs 3 warm-up steps (compiles), then `steps` timed ones; returns (seconds per step, metrics)."""
    import torch_pjrt

    for _ in range(3):
        step()
    barrier()
    torch_pjrt.reset_metrics()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps, torch_pjrt.metrics()


def report(ranks, seconds, m, steps):
    staged, in_xla = m.get("dist_collectives_staged", 0), m.get("dist_collectives_in_xla", 0) + m["collectives_in_xla"]
    print("BENCH " + json.dumps({
        "ranks": ranks, "step_ms": 1000 * seconds, "collectives_per_step": (staged + in_xla) / steps,
        "staged_per_step": staged / steps, "in_xla_per_step": in_xla / steps,
        "bytes_per_step": (m.get("dist_staged_bytes_to_host", 0) + m.get("dist_staged_bytes_to_device", 0)
                           + m["collective_bytes"]) / steps,
        "programs_per_step": m["executions"] / steps, "compiles": m["compiles"]}), flush=True)


def process_worker(args):
    import datetime

    import torch
    import torch.distributed as dist

    import torch_pjrt  # noqa: F401  (registers tpu_dist)

    dist.init_process_group(timeout=datetime.timedelta(seconds=300))
    world = dist.get_world_size()
    torch.manual_seed(0)
    if args.setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(build_model(args.width, args.blocks).to("tpu"))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("tpu", (world,))
        with torch.device("meta"):
            model = build_model(args.width, args.blocks)
        for block in model[:-1]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="tpu")
        torch.manual_seed(0)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, args.width).to("tpu"), torch.randint(0, 10, (32,)).to("tpu")

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    seconds, m = timed_steps(step, args.steps, dist.barrier)
    if dist.get_rank() == 0:
        report(world, seconds, m, args.steps)
    dist.destroy_process_group()


def devices_worker(args):
    import torch

    import torch_pjrt  # noqa: F401
    from torch_pjrt import _xla_collectives as xc

    n = torch.tpu.device_count()
    torch.manual_seed(0)
    cpu_model = build_model(args.width, args.blocks)
    replicas = [build_model(args.width, args.blocks).to(f"tpu:{r}") for r in range(n)]
    for r in replicas:
        r.load_state_dict(cpu_model.state_dict())
    opts = [torch.optim.AdamW(r.parameters(), lr=1e-3) for r in replicas]
    batches = [(torch.randn(32, args.width).to(f"tpu:{r}"), torch.randint(0, 10, (32,)).to(f"tpu:{r}"))
               for r in range(n)]

    def step():
        for model, opt, (x, y) in zip(replicas, opts, batches):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        if n > 1:  # one XLA all_reduce (avg) per parameter, over the devices
            for params in zip(*(r.parameters() for r in replicas)):
                xc.all_reduce_([p.grad for p in params], op="avg")
        for opt in opts:
            opt.step()
        for r in range(n):  # wait for every device's step, as .item() on the loss does for a process
            torch.tpu.synchronize(r)

    seconds, m = timed_steps(step, args.steps, lambda: None)
    report(n, seconds, m, args.steps)


def run_setup(setup, n, args):
    common = ["--worker", f"--setup={setup}", f"--steps={args.steps}", f"--width={args.width}",
              f"--blocks={args.blocks}"]
    env = dict(os.environ)
    if setup == "devices":
        env["TORCH_PJRT_CPU_DEVICES"] = str(n)
        cmd = [sys.executable, __file__] + common
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", __file__] + common
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("BENCH ")]
    if out.returncode or not lines:
        print(f"{setup:>7} {n:>5} failed (exit {out.returncode}): {out.stderr[-2000:]}")
        return
    r = json.loads(lines[0][6:])
    print(f"{setup:>7} {n:>5} {r['step_ms']:>9.1f} {r['collectives_per_step']:>9.1f} {r['staged_per_step']:>7.1f} "
          f"{r['in_xla_per_step']:>7.1f} {r['bytes_per_step']:>13.0f} {r['programs_per_step']:>13.1f} {r['compiles']:>8}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--setups", default="ddp,fsdp2,devices")
    parser.add_argument("--setup", default="ddp")
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return devices_worker(args) if args.setup == "devices" else process_worker(args)
    print(f"{args.blocks} MLP blocks of width {args.width}, batch 32 per rank, AdamW, {args.steps} timed steps, "
          f"mode {os.environ.get('TORCH_PJRT_MODE', 'fused')}; bytes: staged to and from the host, or XLA "
          f"collective inputs summed over devices")
    print(f"{'setup':>7} {'ranks':>5} {'step ms':>9} {'coll/step':>9} {'staged':>7} {'in XLA':>7} {'bytes/step':>13} "
          f"{'programs/step':>13} {'compiles':>8}")
    for setup in args.setups.split(","):
        for n in [int(p) for p in args.procs.split(",")]:
            run_setup(setup, n, args)


if __name__ == "__main__":
    main()
