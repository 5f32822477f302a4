"""Runs `python -m torchtitan.train ARGS` as a user would, with torch_pjrt imported first (what `import torch` does
when torch_pjrt is installed; the tests run it from the source tree), and prints each logged step's loss in full
precision on rank 0 (torchtitan's own log line rounds to 5 decimals):

    TITAN_LOSS step=3 loss=7.123456789 grad_norm=1.23

`--reference-cpu` (first argument) runs the same torchtitan on PyTorch's CPU instead, without torch_pjrt: the
reference. torchtitan has no CPU mode (it takes the accelerator, else "cuda"), so this script makes it pick "cpu"
(Gloo for collectives) and gives `torch.cpu` the device-module functions torchtitan calls (memory monitor, an integer current
device). torch_pjrt/_torchtitan.py (Triton placeholder, torch.distributed.set_timeout) is loaded by its path, alone,
so the reference process never imports torch_pjrt.

Used by tests/python/distributed/test_torchtitan.py under torchrun, in a directory made by titan_assets.py.
"""
import importlib.util
import os
import runpy
import sys
import types

import torch

def say(line):
    """One write per line: the ranks share torchrun's stdout pipe (print may split a line in two writes)."""
    os.write(1, (line + "\n").encode())


ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
args = sys.argv[1:]
reference_cpu = bool(args) and args[0] == "--reference-cpu"
if reference_cpu:
    args = args[1:]
    spec = importlib.util.spec_from_file_location(
        "_titan_compat", os.path.join(ROOT, "python", "torch_pjrt", "_torchtitan.py"))
    compat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compat)
    compat.install()

    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    torch.cpu.get_device_name = lambda device=None: "cpu"
    torch.cpu.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=1 << 34)
    torch.cpu.reset_peak_memory_stats = lambda device=None: None
    torch.cpu.empty_cache = lambda: None
    torch.cpu.memory_stats = lambda device=None: {}
    torch.cpu.current_device = lambda: 0  # torch.cpu's is "cpu"; barrier(device_ids=[current_device()]) needs an int
else:
    import torch_pjrt  # noqa: F401  (registers tpu; must come before torchtitan picks its device at import)

from torchtitan.components import metrics  # noqa: E402
from torchtitan.tools import utils as titan_utils  # noqa: E402

if reference_cpu:
    # CPU flex_attention has no backward (torch refuses it, eager and under Inductor), so the reference runs
    # torch's own dense flex_attention implementation (the higher-order op's forward and backward, what torch
    # runs for flex_attention outside Inductor) on the CPU: torchtitan's torch.compile(flex_attention) and
    # torch.compile(create_block_mask) get the aot_eager backend, and the CPU backward check is skipped.
    import torch.nn.attention.flex_attention as flex
    from torchtitan.models.common import attention

    flex._validate_device = lambda query, key, value: None
    attention.FlexAttention._compiled_flex_attn = torch.compile(flex.flex_attention, backend="aot_eager")
    attention._compiled_create_block_mask = torch.compile(flex.create_block_mask, backend="aot_eager")

    # Gloo has no ReduceOp.PREMUL_SUM, which FSDP2 uses for torchtitan's gradient divide factor: the reference
    # reduce-scatters with SUM and divides after (FSDP2's own fallback, force_sum_reduction_for_comms).
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def _sum_then_divide(*a, **kw):
        kw.pop("force_sum_reduction_for_comms", None)
        if len(a) > 5:
            a = a[:5]
        return divide_factors(*a, force_sum_reduction_for_comms=True, **kw)

    _fsdp_collectives._get_gradient_divide_factors = _sum_then_divide

say(f"TITAN_DEVICE {titan_utils.device_type} torch_pjrt={'torch_pjrt' in sys.modules}")


def _print_losses(log):
    def wrapper(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **kw):
        if int(os.environ.get("RANK", "0")) == 0:
            say(f"TITAN_LOSS step={step} loss={float(global_avg_loss)!r} grad_norm={float(grad_norm)!r}")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *a, **kw)

    return wrapper


metrics.MetricsProcessor.log = _print_losses(metrics.MetricsProcessor.log)

if os.environ.get("TITAN_F64_NORM"):
    from torchtitan.distributed import utils as dist_utils
    from torch.distributed.tensor import DTensor

    clip = dist_utils.clip_grad_norm_

    def clip_grad_norm_(parameters, *a, **kw):
        parameters = list(parameters)
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
        sq = sum(g.detach().to("cpu", torch.float64).square().sum() for g in local)
        say(f"TITAN_F64_NORM_SQ rank={os.environ.get('RANK')} {float(sq)!r}")
        return clip(parameters, *a, **kw)

    dist_utils.clip_grad_norm_ = clip_grad_norm_
sys.argv = ["torchtitan.train", *args]
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)

if not reference_cpu:
    import json

    m = torch_pjrt.metrics()
    say("TITAN_METRICS rank=%s %s" % (os.environ.get("RANK", "0"), json.dumps({
        "routed_graphs": torch_pjrt._compile._routed_graphs[0],  # torch.compile (Inductor) graphs run by `tpu`
        "cpu_fallbacks": m["cpu_fallbacks"],
        "dist_collectives_staged": m["dist_collectives_staged"],
        "compiled_replays": m["compiled_replays"],
    }, default=str)))
