"""One rank fails while the others go on to a collective: they must stop with an error naming the collective and
the rank within the process group's timeout, not hang.

Started once per rank by tests/python/distributed/test_dist_backend.py (not torchrun: its agent would kill the survivors
itself). argv: RANK WORLD STORE_FILE TIMEOUT_S MODE, MODE "raise" (rank 1 raises) or "stall" (rank 1 sleeps).
"""
import datetime
import faulthandler
import signal
import sys
import time

import torch
import torch.distributed as dist

import torch_pjrt  # noqa: F401  (registers tpu_dist)

faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for stacks if this process hangs

rank, world, store_file, timeout_s, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), sys.argv[5]
dist.init_process_group(init_method=f"file://{store_file}", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=timeout_s))
x = torch.ones(4, device="tpu")
dist.all_reduce(x)  # everyone reaches this one
if rank == 1:
    if mode == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(3600)  # stalls; the test kills it
start = time.monotonic()
try:
    dist.all_reduce(x)
except RuntimeError as e:
    print(f"ERROR after {time.monotonic() - start:.1f}s: {e}", flush=True)
    start = time.monotonic()
    try:  # the failed group refuses more work at once rather than waiting out another timeout
        dist.all_reduce(x)
        print("SECOND COLLECTIVE RAN", flush=True)
    except RuntimeError as e:
        print(f"REFUSED after {time.monotonic() - start:.1f}s: {e}", flush=True)
    sys.exit(3)
print("NO ERROR", flush=True)
