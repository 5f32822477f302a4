"""Multi-process FSDP2 / DTensor tensor-parallel / 2-D mesh / checkpoint checks on tpu tensors.

    python fsdp_train.py OUT_DIR NPROC CASE[,CASE...]

Spawns NPROC processes (each sees its chip as tpu:0), runs the cases in order
and writes OUT_DIR/rank{R}.pt: per case the losses and the full (gathered, CPU)
parameters after the steps, plus the process's CPU-fallback counts. The pytest
side (test_fsdp_dtensor.py) compares them with fsdp_models.reference on the CPU.
Cases: fsdp, tp_mlp, tp_attn, fsdp_tp (needs 4 processes: a 2x2 mesh), dcp,
dcp_reshard (loads the dcp case's checkpoint, named by FSDP_TEST_CHECKPOINT).
"""
import datetime
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_models as M  # noqa: E402

GLOBAL_BATCH = 8
TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("FSDP_TEST_COLLECTIVE_TIMEOUT", "180")))


def local_slice(full, dt):
    """This rank's part of a full CPU tensor, laid out as DTensor dt's local tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(full.shape, dt.device_mesh, dt.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


def load_initial(model, kind):
    """Writes the reference's initial values into a (sharded, materialized) model, no collectives."""
    from torch.distributed.tensor import DTensor
    init = M.initial_state(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if isinstance(p, DTensor):
                p.to_local().copy_(local_slice(init[name], p))
            else:
                p.copy_(init[name])


def full_params(model):
    from torch.distributed.tensor import DTensor
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().cpu()
    return out


def tp_plan(module):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if isinstance(module, M.Attention):
        return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "out": RowwiseParallel()}
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def build(kind, dp_mesh=None, tp_mesh=None):
    """Meta-device model, tensor parallel and/or fully_shard, then to_empty(device="tpu") and init."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    with torch.device("meta"):
        model = M.make(kind)
    if tp_mesh is not None:
        for layer in model.layers:
            parallelize_module(layer, tp_mesh, tp_plan(layer))
    if dp_mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)
    model.to_empty(device="tpu")
    load_initial(model, kind)
    return model


STEP_METRICS = ("compiles", "graphs", "executions", "dist_collectives_staged")


def step_metrics():
    import torch_pjrt
    m = torch_pjrt.metrics()
    return [m[k] for k in STEP_METRICS]


def train(model, kind, dp_rank, dp_size, per_step=None):
    """STEPS AdamW steps on this dp rank's slice; per_step (a list) gets each step's STEP_METRICS deltas."""
    opt = M.optimizer(model.parameters())
    per = GLOBAL_BATCH // dp_size
    losses = []
    for x, y in M.batches(kind, GLOBAL_BATCH):
        before = step_metrics()
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        loss = M.loss_fn(model(x.to("tpu")), y.to("tpu"))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if per_step is not None:
            per_step.append([b - a for a, b in zip(before, step_metrics())])
    return opt, [v.item() for v in losses]


def watch_reshard(model):
    """Per block forward: bytes of its unsharded parameters' storages while it runs and after it returns."""
    seen = {"during": [], "after": []}

    def unsharded_bytes(layer):
        group = layer._get_fsdp_state()._fsdp_param_group
        return sum(t.untyped_storage().nbytes() for fp in group.fsdp_params for t in fp.all_gather_outputs)
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda m, args: seen["during"].append(unsharded_bytes(m)))
        layer.register_forward_hook(lambda m, args, out: seen["after"].append(unsharded_bytes(m)))
    return seen


def case_fsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("tpu", (world,))
    model = build("mlp", dp_mesh=mesh)
    reshard = watch_reshard(model)
    per_step = []
    _, losses = train(model, "mlp", rank, world, per_step)
    return {"losses": losses, "params": full_params(model), "reshard": reshard, "per_step": per_step}


def case_tp(kind):
    def run(rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("tpu", (world,))
        model = build(kind, tp_mesh=mesh)
        _, losses = train(model, kind, 0, 1)
        return {"losses": losses, "params": full_params(model)}
    return run


def case_fsdp_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    assert world == 4, "fsdp_tp runs on a 2x2 mesh"
    mesh = init_device_mesh("tpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("attn", dp_mesh=mesh["dp"], tp_mesh=mesh["tp"])
    per_step = []
    _, losses = train(model, "attn", mesh["dp"].get_local_rank(), 2, per_step)
    return {"losses": losses, "params": full_params(model), "dp_rank": mesh["dp"].get_local_rank(),
            "per_step": per_step}


def mismatches(model, opt, other, other_opt):
    """Names of this rank's parameter shards and optimizer states that differ between two models."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu()
    found = []
    others = dict(other.named_parameters())
    for name, p in model.named_parameters():
        q = others[name]
        if not torch.equal(local(p), local(q)):
            found.append(name)
        for key, v in opt.state[p].items():
            if not torch.equal(local(v), local(other_opt.state[q][key])):
                found.append(f"{name}.{key}")
    return found


def case_dcp(rank, world, out_dir):
    """Sharded async_save/load of FSDP2 model + optimizer state; a full CPU state dict saved by rank 0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_state_dict, set_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("tpu", (world,))
    model = build("mlp", dp_mesh=mesh)
    opt, _ = train(model, "mlp", rank, world)
    msd, osd = get_state_dict(model, opt)
    ckpt = os.path.join(out_dir, "dcp")
    # async_save: staged before it returns, written in the background. Parameters changed in place while it
    # writes (doubled, then halved back: exact) must not reach the checkpoint, which the load below checks.
    saving = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(2)
    saving.result()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().div_(2)

    fresh = build("mlp", dp_mesh=mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.to_local().zero_()
    fresh_opt = M.optimizer(fresh.parameters())
    fmsd, fosd = get_state_dict(fresh, fresh_opt)  # optimizer state is created (zeros) here
    state = {"model": fmsd, "optim": fosd}
    differed_before = mismatches(model, opt, fresh, fresh_opt)
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    mismatch = mismatches(model, opt, fresh, fresh_opt)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, os.path.join(out_dir, "full_state.pt"))
    dist.barrier()
    n_opt_states = sum(len(s) for s in fresh_opt.state.values())
    return {"mismatch": mismatch, "differed_before": differed_before, "params": full_params(model),
            "n_opt_states": n_opt_states, "fresh_params": full_params(fresh), "full_optim": full_optim(model, opt)}


def full_optim(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # cpu_offload: rank 0 gets the whole state, the others an empty dict
    return {f"{name}.{key}": v for name, state in sd.get("state", {}).items() for key, v in state.items()}


def case_dcp_reshard(rank, world):
    """Loads the checkpoint another launch saved with a different world size (FSDP_TEST_CHECKPOINT)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("tpu", (world,))
    model = build("mlp", dp_mesh=mesh)
    opt = M.optimizer(model.parameters())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=os.environ["FSDP_TEST_CHECKPOINT"])
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"params": full_params(model), "full_optim": full_optim(model, opt)}


def worker(rank, world, out_dir, cases, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist
    import torch_pjrt
    dist.init_process_group(timeout=TIMEOUT)  # cpu:gloo,tpu:tpu_dist
    results = {}
    runners = {"fsdp": case_fsdp, "tp_mlp": case_tp("mlp"), "tp_attn": case_tp("attn"),
               "fsdp_tp": case_fsdp_tp, "dcp": lambda r, w: case_dcp(r, w, out_dir),
               "dcp_reshard": case_dcp_reshard}
    try:
        for case in cases:
            results[case] = runners[case](rank, world)
        metrics = torch_pjrt.metrics()
        results["cpu_fallbacks"] = dict(metrics.get("cpu_fallbacks", {}))
        results["dist"] = {k: v for k, v in metrics.items() if k.startswith("dist_")}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    out_dir, nproc, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    mp.spawn(worker, args=(nproc, out_dir, cases, free_port()), nprocs=nproc, join=True)
