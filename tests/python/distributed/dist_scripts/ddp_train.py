"""DDP on tpu through tpu_dist: 10 SGD steps of a small MLP on the global batch split over the ranks, against one
process training on the whole batch on the CPU. With --mpmd, rank 0 also evaluates and saves a checkpoint (a CPU
copy) every 3 steps while the other ranks do not.

Run by torchrun (tests/python/distributed/test_dist_backend.py). Prints "RESULT rank=R ..." and exits 1 on a mismatch.
"""
import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import torch_pjrt


def say(line):
    """One write per line: the ranks share torchrun's stdout pipe (print may split a line in two writes)."""
    os.write(1, (line + "\n").encode())

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="cpu:gloo,tpu:tpu_dist")
parser.add_argument("--mpmd", action="store_true")
parser.add_argument("--bucket-views", action="store_true")
parser.add_argument("--checkpoint-dir", default="")
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

dist.init_process_group(backend=args.backend, timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
torch_pjrt.reset_metrics()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8 * world, 8, generator=g), torch.randn(8 * world, 4, generator=g)


# The reference: one process, the global batch, on the CPU.
ref = make_model()
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
ref_losses = []
for step in range(args.steps):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(ref(x), y)
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
    ref_losses.append(loss.item())

model = DDP(make_model().to("tpu"), gradient_as_bucket_view=args.bucket_views, bucket_cap_mb=0.001)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
losses = []
eval_x = torch.randn(16, 8, generator=torch.Generator().manual_seed(99)).to("tpu")
for step in range(args.steps):
    x, y = batch(step)
    x, y = x[rank * 8:(rank + 1) * 8].to("tpu"), y[rank * 8:(rank + 1) * 8].to("tpu")
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
    losses.append(global_loss.item())
    if args.mpmd and rank == 0 and step % 3 == 2:
        # rank 0 only: an evaluation (its own graphs) and a checkpoint of a CPU copy
        with torch.no_grad():
            model.module(eval_x).sum().item()
        state = {k: v.cpu() for k, v in model.module.state_dict().items()}
        torch.save(state, os.path.join(args.checkpoint_dir, f"step{step}.pt"))

failures = []
for step, (got, want) in enumerate(zip(losses, ref_losses)):
    if abs(got - want) > 1e-5 * max(1.0, abs(want)):
        failures.append(f"loss at step {step}: {got} vs one process {want}")
for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
    if not torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5):
        failures.append(f"parameter {name}: max diff {(p.detach().cpu() - q.detach()).abs().max().item()}")
if args.mpmd and rank == 0:
    saved = [f for f in os.listdir(args.checkpoint_dir) if f.endswith(".pt")]
    if sorted(saved) != [f"step{s}.pt" for s in range(args.steps) if s % 3 == 2]:
        failures.append(f"checkpoints saved: {sorted(saved)}")
    last = torch.load(os.path.join(args.checkpoint_dir, sorted(saved)[-1]))
    if not all(t.device.type == "cpu" for t in last.values()):
        failures.append("checkpoint tensors not on the cpu")
m = torch_pjrt.metrics()
for f in failures:
    say(f"rank {rank} FAIL {f}")
say(f"RESULT rank={rank} failures={len(failures)} staged={m['dist_collectives_staged']} "
      f"to_host={m['dist_staged_bytes_to_host']} losses={[round(v, 6) for v in losses]}")
dist.destroy_process_group()
sys.exit(1 if failures else 0)
