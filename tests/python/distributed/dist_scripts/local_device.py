"""torchrun's device convention: with TORCH_PJRT_CPU_DEVICES=N each process's current device is LOCAL_RANK % N
(set at import); with one device per process every rank sees its device as tpu:0. Collectives use that device.
Prints "RESULT rank=R failures=F"."""
import os
import sys

import torch
import torch.distributed as dist

import torch_pjrt  # noqa: F401


def say(line):
    """One write per line: the ranks share torchrun's stdout pipe (print may split a line in two writes)."""
    os.write(1, (line + "\n").encode())

dist.init_process_group()
rank, world = dist.get_rank(), dist.get_world_size()
per_process = int(os.environ.get("TORCH_PJRT_CPU_DEVICES", "1"))
want_device = int(os.environ["LOCAL_RANK"]) % per_process
failures = []
if torch.tpu.device_count() != per_process:
    failures.append(f"device_count {torch.tpu.device_count()} != {per_process}")
if torch.accelerator.current_device_index() != want_device:
    failures.append(f"current device {torch.accelerator.current_device_index()} != {want_device}")
x = torch.full((3,), float(rank + 1), device="tpu")
if x.device.index != want_device:
    failures.append(f"new tensors on {x.device}")
dist.all_reduce(x)
dist.barrier(device_ids=[torch.accelerator.current_device_index()])  # transformers' barrier
want = torch.full((3,), float(world * (world + 1) // 2))
if not torch.equal(x.cpu(), want) or x.device.index != want_device:
    failures.append(f"all_reduce gave {x} (want {want} on tpu:{want_device})")
for f in failures:
    say(f"rank {rank} FAIL {f}")
say(f"RESULT rank={rank} failures={len(failures)}")
dist.destroy_process_group()
sys.exit(1 if failures else 0)
