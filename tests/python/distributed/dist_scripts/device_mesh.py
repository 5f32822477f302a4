"""A 2-D DeviceMesh on tpu with init_process_group(device_id=...): its subgroups come from split_group
(tpu_dist splits itself), each dimension's all_reduce sums over the right ranks, and a DTensor redistributes.
Prints "RESULT rank=R failures=F"."""
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import torch_pjrt  # noqa: F401


def say(line):
    """One write per line: the ranks share torchrun's stdout pipe (print may split a line in two writes)."""
    os.write(1, (line + "\n").encode())

dist.init_process_group(device_id=torch.device("tpu", torch.accelerator.current_device_index()))
rank, world = dist.get_rank(), dist.get_world_size()
rows, cols = 2, world // 2
mesh = init_device_mesh("tpu", (rows, cols), mesh_dim_names=("dp", "tp"))
failures = []
# rank = row * cols + col; "dp" groups share a column, "tp" groups share a row
row, col = divmod(rank, cols)
for dim, members in (("dp", [r * cols + col for r in range(rows)]), ("tp", [row * cols + c for c in range(cols)])):
    group = mesh.get_group(dim)
    if sorted(dist.get_process_group_ranks(group)) != members:
        failures.append(f"{dim} group ranks {dist.get_process_group_ranks(group)} != {members}")
    x = torch.full((2,), float(rank + 1), device="tpu")
    dist.all_reduce(x, group=group)
    want = float(sum(m + 1 for m in members))
    if x.cpu().tolist() != [want, want]:
        failures.append(f"all_reduce over {dim}: {x.cpu().tolist()} != {want}")
full = torch.arange(4.0 * world * 3).reshape(4 * world, 3)
d = distribute_tensor(full.to("tpu"), mesh, [Shard(0), Shard(1) if cols > 1 else Replicate()])
if not torch.equal(d.full_tensor().cpu(), full):
    failures.append("DTensor full_tensor differs")
if not torch.equal(d.redistribute(mesh, [Replicate(), Replicate()]).to_local().cpu(), full):
    failures.append("DTensor redistribute to Replicate differs")
for f in failures:
    say(f"rank {rank} FAIL {f}")
say(f"RESULT rank={rank} failures={len(failures)}")
dist.destroy_process_group()
sys.exit(1 if failures else 0)
