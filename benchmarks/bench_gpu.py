"""GPU benchmark, for a machine with an NVIDIA GPU and the CUDA PJRT plugin
(run by tools/gpu_check.sh with TORCH_PJRT_PLUGIN=cuda). Side by side in one run,
measured round-robin (one step of each column in turn):

- the GPT training step of bench_fused.py (4 layers, width 256, batch 4, seq 128,
  AdamW) and a GPT-2-small-sized one (12 layers, width 768, batch 8, seq 512,
  vocabulary 8192), float32;
- columns: PyTorch's own CUDA eager, torch_pjrt strict / fused / compiled
  (torch.compile(backend="tpu")) on the CUDA plugin, and the same step as one
  jax.jit program on jax's CUDA backend (if jax is installed);
- host cost per op on tiny tensors: fused recording against PyTorch CUDA eager.

Every column computes in float32 with each framework's default matmul precision
on the GPU (PyTorch CUDA: full float32; XLA:GPU: its default), printed below.

    TORCH_PJRT_PLUGIN=cuda PYTHONPATH=python python benchmarks/bench_gpu.py [--quick]
"""
import json
import os
import subprocess
import sys
import time

import torch

import torch_pjrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compile_backend import compiled_stepper, eager_stepper, round_robin  # noqa: E402
from bench_fused import gpt_setup  # noqa: E402
from gpt_model import gpt2_small_setup  # noqa: E402

median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
# The reference column: PyTorch on the GPU (on a machine without one, its CPU, to try the script).
# It runs in its own process, which never imports torch_pjrt: once a PrivateUse1
# backend is registered, PyTorch takes it as the process's accelerator, and the
# autograd engine's stream bookkeeping for CUDA tensors fails (torch 2.11:
# "opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED").
REF = "cuda" if torch.cuda.is_available() else "cpu"

REFERENCE = """
import json, sys, time
import torch
sys.path.insert(0, {bench_dir!r})
import gpt_model
steps, device = {steps}, {device!r}
step = gpt_model.training_step(getattr(gpt_model, {setup!r}), device)
step(); step()
times = []
for _ in range(steps):
    start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
a = torch.randn(4, 4, device=device)
per_op = []
for _ in range(5):
    start = time.perf_counter()
    b = a
    for _ in range(500):
        b = b + 1.0
    per_op.append((time.perf_counter() - start) / 500 * 1e6)
    b.cpu()
print(json.dumps(dict(step=sorted(times)[len(times) // 2], per_op_us=sorted(per_op)[2])))
"""


def reference(setup_name, steps):
    """(median step seconds, us per tiny op) of PyTorch's own REF device, in a process without torch_pjrt."""
    code = REFERENCE.format(bench_dir=os.path.dirname(os.path.abspath(__file__)), setup=setup_name, steps=steps,
                            device=REF)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"the {REF} reference process failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["step"], result["per_op_us"]


def timed(label, make):
    start = time.perf_counter()
    value = make()
    print(f"  ({label}: set up and first steps in {time.perf_counter() - start:.1f} s)", flush=True)
    return value


def warm(step, n=2):
    for _ in range(n):
        step()
    return step


def side_by_side(setup, steps, with_strict):
    steppers = {}
    modes = ("strict", "fused") if with_strict else ("fused",)
    for mode in modes:
        steppers["tpu " + mode] = timed("tpu " + mode, lambda: warm(eager_stepper(setup, "tpu", mode)))
    steppers["tpu compiled"], programs, _ = timed("tpu compiled", lambda: compiled_stepper(setup))
    try:
        import jax
        import jax_gpt

        torch.manual_seed(0)
        model, x, y = setup("cpu")
        trainer = timed("jax.jit", lambda: jax_gpt.JaxTrainer(
            model, x, y, layers=len(model.blocks), heads=model.blocks[0].heads))
        warm(trainer.step)
        steppers[f"jax.jit ({jax.default_backend()})"] = trainer.step
    except Exception as e:  # noqa: BLE001 - jax is optional here
        print(f"  (jax.jit column skipped: {type(e).__name__}: {e})")
    times = round_robin(steppers, steps)
    times = {REF + " eager": reference(setup.__name__, steps)[0], **times}  # its own process, see REFERENCE
    ref = times[REF + " eager"]
    for name, t in times.items():
        print(f"{name:20s} {t * 1e3:9.2f} ms/step  {ref / t:5.2f}x {REF} eager")
    print(f"compiled: {programs} XLA programs per step; fused vs {REF} eager "
          f"{ref / times['tpu fused']:.2f}x, compiled vs fused {times['tpu fused'] / times['tpu compiled']:.2f}x")
    return times


def per_op_cost(device, n=500):
    """Host microseconds per recorded op (the graph runs outside the clock)."""
    def loop(a):
        start = time.perf_counter()
        b = a
        for _ in range(n):
            b = b + 1.0
        return (time.perf_counter() - start) / n * 1e6, b

    a = torch.randn(4, 4, device=device)
    out = []
    for _ in range(5):
        with torch_pjrt.mode("fused"):
            us, b = loop(a)
            b.cpu()  # the fused graph runs here, outside the clock
        out.append(us)
    return median(out)


def main():
    quick = "--quick" in sys.argv
    print("platform:", torch_pjrt.platform(), "| torch", torch.__version__, "|",
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA torch")
    print("matmul precision: PyTorch float32", torch.get_float32_matmul_precision(),
          "| XLA:GPU default (TF32 allowed)")
    fused_us, cuda_us = per_op_cost("tpu"), reference("gpt_small_batch_setup", 3)[1]
    print(f"\n== host cost per op (4x4 add, 500 ops): fused recording {fused_us:.1f} us, "
          f"PyTorch {REF} eager {cuda_us:.1f} us: {fused_us / cuda_us:.2f}x ==")
    sizes = [("GPT 4x256, batch 4, seq 128", gpt_setup, 15, True)]
    if not quick:
        sizes.append(("GPT 12x768, batch 8, seq 512, vocab 8192", gpt2_small_setup, 7, False))
    for name, setup, steps, with_strict in sizes:
        print(f"\n== {name}: training step (forward, backward, AdamW), round-robin ==", flush=True)
        side_by_side(setup, steps, with_strict)


if __name__ == "__main__":
    main()
