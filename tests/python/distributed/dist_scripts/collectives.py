"""Every c10d collective on tpu tensors through tpu_dist, against the same collective on CPU tensors with Gloo.

Run by torchrun (tests/python/distributed/test_dist_backend.py): python -m torch.distributed.run --nproc-per-node N
collectives.py BACKEND, where BACKEND is "default" (init_process_group() with no backend), "tpu_dist" or
"cpu:gloo,tpu:tpu_dist". Prints "RESULT rank=R checks=K failures=F" and exits 1 on any failure.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_pjrt


def say(line):
    """One write per line: the ranks share torchrun's stdout pipe (print may split a line in two writes)."""
    os.write(1, (line + "\n").encode())

failures = []
checks = 0


def check(name, got, want):
    global checks
    checks += 1
    got = got.cpu() if isinstance(got, torch.Tensor) else got
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
        failures.append(f"{name}: got {got!r}, want {want!r}")


def check_close(name, got, want):
    """Floating sums whose order Gloo picks by buffer layout (a coalesced buffer vs one per tensor)."""
    global checks
    checks += 1
    got = got.cpu()
    if got.dtype != want.dtype or not torch.allclose(got, want, rtol=1e-6, atol=1e-6):
        failures.append(f"{name}: got {got!r}, want {want!r}")


def data(shape, dtype, salt=0):
    """Per-rank values; small integers so products and sums stay exact."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(1, 6, shape, generator=g, dtype=dtype)


def both(make):
    """(tpu tensor, cpu tensor) with the same values."""
    t = make()
    return t.to("tpu"), t.clone()


backend = sys.argv[1]
timeout = datetime.timedelta(seconds=60)
if backend == "default":
    dist.init_process_group(timeout=timeout)
else:
    dist.init_process_group(backend=backend, timeout=timeout)
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
torch_pjrt.reset_metrics()

ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
int_ops = {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}

for dtype in (torch.float32, torch.int64):
    tag = str(dtype).split(".")[1]
    for name, op in {**ops, **(int_ops if not dtype.is_floating_point else {})}.items():
        x, ref = both(lambda: data((5, 3), dtype))
        dist.all_reduce(x, op=op)
        dist.all_reduce(ref, op=op, group=gloo)
        check(f"all_reduce {name} {tag}", x, ref)
        x, ref = both(lambda: data((4,), dtype, 1))
        dist.reduce(x, dst=world - 1, op=op)
        dist.reduce(ref, dst=world - 1, op=op, group=gloo)
        check(f"reduce {name} {tag}", x, ref)

    # async_op: the work's future carries the reduced tensor
    x, ref = both(lambda: data((6,), dtype, 2))
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    dist.all_reduce(ref, group=gloo)
    check(f"all_reduce async {tag}", x, ref)
    check(f"all_reduce future {tag}", work.get_future().value()[0], ref)

    # a view into a bigger tensor (DDP's bucket views): only the view changes
    base, base_ref = both(lambda: data((4, 3), dtype, 3))
    dist.all_reduce(base[:, 1])
    view_ref = base_ref[:, 1].contiguous()
    dist.all_reduce(view_ref, group=gloo)
    base_ref[:, 1] = view_ref
    check(f"all_reduce on a strided view {tag}", base, base_ref)

    x, ref = both(lambda: data((3, 2), dtype, 4))
    dist.broadcast(x, src=world - 1)
    dist.broadcast(ref, src=world - 1, group=gloo)
    check(f"broadcast {tag}", x, ref)

    x, ref = both(lambda: data((2, 3), dtype, 5))
    outs = [torch.zeros(2, 3, dtype=dtype, device="tpu") for _ in range(world)]
    outs_ref = [torch.zeros(2, 3, dtype=dtype) for _ in range(world)]
    dist.all_gather(outs, x)
    dist.all_gather(outs_ref, ref, group=gloo)
    check(f"all_gather {tag}", torch.stack([o.cpu() for o in outs]), torch.stack(outs_ref))

    out = torch.zeros(world * 2, 3, dtype=dtype, device="tpu")
    out_ref = torch.zeros(world * 2, 3, dtype=dtype)
    dist.all_gather_into_tensor(out, x)
    dist.all_gather_into_tensor(out_ref, ref, group=gloo)
    check(f"all_gather_into_tensor {tag}", out, out_ref)

    ins, ins_ref = zip(*[both(lambda i=i: data((2,), dtype, 6 + i)) for i in range(world)])
    out, out_ref = torch.zeros(2, dtype=dtype, device="tpu"), torch.zeros(2, dtype=dtype)
    dist.reduce_scatter(out, list(ins))
    dist.reduce_scatter(out_ref, list(ins_ref), group=gloo)
    check(f"reduce_scatter {tag}", out, out_ref)

    x, ref = both(lambda: data((world * 3, 2), dtype, 7))
    out, out_ref = torch.zeros(3, 2, dtype=dtype, device="tpu"), torch.zeros(3, 2, dtype=dtype)
    dist.reduce_scatter_tensor(out, x)
    dist.reduce_scatter_tensor(out_ref, ref, group=gloo)
    check(f"reduce_scatter_tensor {tag}", out, out_ref)

    # the coalesced forms, as ProcessGroup methods (FSDP and functional collectives call these)
    pg, pg_ref = dist.group.WORLD, gloo
    xs, xs_ref = zip(*[both(lambda i=i: data((3 + i,), dtype, 8 + i)) for i in range(3)])
    pg.allreduce_coalesced(list(xs)).wait()
    pg_ref.allreduce_coalesced(list(xs_ref)).wait()
    for i in range(3):
        check(f"allreduce_coalesced[{i}] {tag}", xs[i], xs_ref[i])
    outs = [torch.zeros(world * (2 + i), dtype=dtype, device="tpu") for i in range(2)]
    outs_ref = [torch.zeros(world * (2 + i), dtype=dtype) for i in range(2)]
    ins, ins_ref = zip(*[both(lambda i=i: data((2 + i,), dtype, 11 + i)) for i in range(2)])
    pg.allgather_into_tensor_coalesced(outs, list(ins)).wait()
    for o, i in zip(outs_ref, ins_ref):  # Gloo's CPU group has no coalesced form: one call per tensor
        dist.all_gather_into_tensor(o, i, group=gloo)
    for i in range(2):
        check(f"allgather_into_tensor_coalesced[{i}] {tag}", outs[i], outs_ref[i])
    outs = [torch.zeros(2 + i, dtype=dtype, device="tpu") for i in range(2)]
    outs_ref = [torch.zeros(2 + i, dtype=dtype) for i in range(2)]
    ins, ins_ref = zip(*[both(lambda i=i: data((world * (2 + i),), dtype, 13 + i)) for i in range(2)])
    pg.reduce_scatter_tensor_coalesced(outs, list(ins)).wait()
    for o, i in zip(outs_ref, ins_ref):
        dist.reduce_scatter_tensor(o, i, group=gloo)
    for i in range(2):
        check_close(f"reduce_scatter_tensor_coalesced[{i}] {tag}", outs[i], outs_ref[i])

    # all_to_all_single with uneven split sizes: rank r sends (j + 1) rows to rank j
    in_splits = [j + 1 for j in range(world)]
    out_splits = [rank + 1] * world
    x, ref = both(lambda: data((sum(in_splits), 2), dtype, 15))
    out = torch.zeros(sum(out_splits), 2, dtype=dtype, device="tpu")
    out_ref = torch.zeros(sum(out_splits), 2, dtype=dtype)
    dist.all_to_all_single(out, x, out_splits, in_splits)
    dist.all_to_all_single(out_ref, ref, out_splits, in_splits, group=gloo)
    check(f"all_to_all_single uneven {tag}", out, out_ref)

    # all_to_all (lists): Gloo has no list form on the CPU; the reference is all_to_all_single of the concatenation
    ins, ins_ref = zip(*[both(lambda j=j: data((j + 1, 2), dtype, 16 + j)) for j in range(world)])
    outs = [torch.zeros(rank + 1, 2, dtype=dtype, device="tpu") for _ in range(world)]
    dist.all_to_all(outs, list(ins))
    out_ref = torch.zeros(world * (rank + 1), 2, dtype=dtype)
    dist.all_to_all_single(out_ref, torch.cat(ins_ref), [rank + 1] * world, [j + 1 for j in range(world)], group=gloo)
    check(f"all_to_all {tag}", torch.cat([o.cpu() for o in outs]), out_ref)

    x, ref = both(lambda: data((3,), dtype, 20))
    gathered = [torch.zeros(3, dtype=dtype, device="tpu") for _ in range(world)] if rank == 0 else None
    gathered_ref = [torch.zeros(3, dtype=dtype) for _ in range(world)] if rank == 0 else None
    dist.gather(x, gathered, dst=0)
    dist.gather(ref, gathered_ref, dst=0, group=gloo)
    if rank == 0:
        check(f"gather {tag}", torch.stack([g.cpu() for g in gathered]), torch.stack(gathered_ref))

    pieces, pieces_ref = zip(*[both(lambda j=j: data((2,), dtype, 21 + j)) for j in range(world)])
    out, out_ref = torch.zeros(2, dtype=dtype, device="tpu"), torch.zeros(2, dtype=dtype)
    dist.scatter(out, list(pieces) if rank == 0 else None, src=0)
    dist.scatter(out_ref, list(pieces_ref) if rank == 0 else None, src=0, group=gloo)
    check(f"scatter {tag}", out, out_ref)

    if world > 1:  # point to point needs a peer
        # point to point on a ring; irecv posted before isend must not deadlock
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        x = data((4,), dtype, 30).to("tpu")
        got = torch.zeros(4, dtype=dtype, device="tpu")
        recv_work = dist.irecv(got, src=prv)
        send_work = dist.isend(x, dst=nxt)
        recv_work.wait()
        send_work.wait()
        g = torch.Generator().manual_seed(1000 * prv + 30)
        want = torch.randn((4,), generator=g).to(dtype) if dtype.is_floating_point else torch.randint(
            1, 6, (4,), generator=g, dtype=dtype)
        check(f"irecv/isend ring {tag}", got, want)
        got2 = torch.zeros(4, dtype=dtype, device="tpu")
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got2, prv), dist.P2POp(dist.isend, x, nxt)])
        for r in reqs:
            r.wait()
        check(f"batch_isend_irecv {tag}", got2, want)
        if rank == 0:
            dist.send(x, dst=world - 1)
        elif rank == world - 1:
            got3 = torch.zeros(4, dtype=dtype, device="tpu")
            dist.recv(got3, src=0)
            g = torch.Generator().manual_seed(30)
            want0 = torch.randn((4,), generator=g).to(dtype) if dtype.is_floating_point else torch.randint(
                1, 6, (4,), generator=g, dtype=dtype)
            check(f"send/recv {tag}", got3, want0)

# AVG (Gloo has none: the reference is SUM / world)
for dtype in (torch.float32, torch.bfloat16):
    x, ref = both(lambda: data((5,), dtype, 40))
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    dist.all_reduce(ref, group=gloo)
    check(f"all_reduce avg {dtype}", x, ref / world)
    x, ref = both(lambda: data((world * 2,), dtype, 41))
    out, out_ref = torch.zeros(2, dtype=dtype, device="tpu"), torch.zeros(2, dtype=dtype)
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.AVG)
    dist.reduce_scatter_tensor(out_ref, ref, group=gloo)
    check(f"reduce_scatter_tensor avg {dtype}", out, out_ref / world)

# PREMUL_SUM (NCCL's; FSDP2's gradient divide factor): each rank's input times the factor, then SUM. Gloo has
# none: the reference scales the CPU copy, then sums. The factor: a float or a one-element tensor.
for factor in (0.25, torch.tensor([1 / 3])):
    tag = "tensor factor" if isinstance(factor, torch.Tensor) else "float factor"
    f_dev = factor.to("tpu") if isinstance(factor, torch.Tensor) else factor
    x, ref = both(lambda: data((5,), torch.float32, 42))
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(f_dev))
    ref.mul_(factor)
    dist.all_reduce(ref, group=gloo)
    check(f"all_reduce premul_sum {tag}", x, ref)
    x, ref = both(lambda: data((world * 2,), torch.float32, 43))
    out, out_ref = torch.zeros(2, device="tpu"), torch.zeros(2)
    dist.reduce_scatter_tensor(out, x, op=dist._make_nccl_premul_sum(f_dev))
    dist.reduce_scatter_tensor(out_ref, ref * factor, group=gloo)
    check(f"reduce_scatter_tensor premul_sum {tag}", out, out_ref)
    check(f"reduce_scatter_tensor premul_sum keeps its input {tag}", x, ref)

try:
    dist.all_reduce(torch.ones(2, dtype=torch.int64, device="tpu"), op=dist.ReduceOp.AVG)
    failures.append("integer AVG did not raise")
except TypeError as e:
    check("integer AVG raises", torch.tensor("AVG" in str(e)), torch.tensor(True))

# bfloat16 data movement and sum
x, ref = both(lambda: data((4, 2), torch.bfloat16, 50))
dist.all_reduce(x)
dist.all_reduce(ref, group=gloo)
check("all_reduce sum bfloat16", x, ref)
x, ref = both(lambda: data((3,), torch.bfloat16, 51))
dist.broadcast(x, src=0)
dist.broadcast(ref, src=0, group=gloo)
check("broadcast bfloat16", x, ref)

# functional collectives (DTensor's path: C++ ops that find the backend through the dispatcher)
x, ref = both(lambda: data((4,), torch.float32, 60))
y = funcol.all_reduce(x, "sum", dist.group.WORLD)
dist.all_reduce(ref, group=gloo)
check("funcol.all_reduce", funcol.wait_tensor(y), ref)
x, ref = both(lambda: data((2, 3), torch.float32, 61))
y = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
out_ref = torch.zeros(world * 2, 3)
dist.all_gather_into_tensor(out_ref, ref, group=gloo)
check("funcol.all_gather_tensor", funcol.wait_tensor(y), out_ref)
x, ref = both(lambda: data((world * 2,), torch.float32, 62))
y = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)
out_ref = torch.zeros(2)
dist.reduce_scatter_tensor(out_ref, ref, group=gloo)
check("funcol.reduce_scatter_tensor", funcol.wait_tensor(y), out_ref)

# object collectives (pickled bytes in uint8 tensors on the group's device)
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
check("all_gather_object", torch.tensor([o["rank"] for o in objs]), torch.arange(world))
box = [f"from rank {rank}", rank] if rank == world - 1 else [None, None]
dist.broadcast_object_list(box, src=world - 1)
check("broadcast_object_list", torch.tensor(box[1]), torch.tensor(world - 1))

# a subgroup of the first and last rank (its own Gloo group; group ranks != global ranks)
members = sorted({0, world - 1})
sub = dist.new_group(members)
sub_ref = dist.new_group(members, backend="gloo")
if rank in members:
    x, ref = both(lambda: data((3,), torch.float32, 80))
    dist.all_reduce(x, group=sub)
    dist.all_reduce(ref, group=sub_ref)
    check("all_reduce on a subgroup", x, ref)
    x, ref = both(lambda: data((2,), torch.int64, 81))
    dist.broadcast(x, src=world - 1, group=sub)
    dist.broadcast(ref, src=world - 1, group=sub_ref)
    check("broadcast on a subgroup from a global rank", x, ref)

# cpu tensors on the default group, and barrier
c = data((3,), torch.float32, 70)
c_ref = c.clone()
dist.all_reduce(c)
dist.all_reduce(c_ref, group=gloo)
check("all_reduce of cpu tensors on the default group", c, c_ref)
dist.barrier()

m = torch_pjrt.metrics()
if world > 1:
    check("metrics count staged collectives", torch.tensor(m["dist_collectives_staged"] > 50), torch.tensor(True))
    check("metrics count staged bytes", torch.tensor(m["dist_staged_bytes_to_host"] > 0 and
                                                     m["dist_staged_bytes_to_device"] > 0), torch.tensor(True))
else:  # one rank: every collective is a device copy or nothing, recorded into the pending graph
    x, ref = both(lambda: data((6,), torch.float32, 90))
    graphs = torch_pjrt.metrics()["graphs"]
    y = x * 2
    dist.all_reduce(y)
    out = torch.zeros(6, device="tpu")
    dist.all_gather_into_tensor(out, y + 1)
    ran_between = torch_pjrt.metrics()["graphs"] - graphs
    check("one rank: collectives join the pending graph", torch.tensor(ran_between), torch.tensor(0))
    check("one rank: the values", out, ref * 2 + 1)
    check("one rank stages nothing", torch.tensor([m["dist_collectives_staged"], m["dist_staged_bytes_to_host"]]),
          torch.tensor([0, 0]))
    check("one rank counts local collectives", torch.tensor(m["dist_collectives_local"] > 50), torch.tensor(True))

for f in failures:
    say(f"rank {rank} FAIL {f}")
say(f"RESULT rank={rank} checks={checks} failures={len(failures)} staged={m['dist_collectives_staged']}")
dist.destroy_process_group()
sys.exit(1 if failures else 0)
