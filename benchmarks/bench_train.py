"""The trainer (`python -m torch_pjrt.train`) on 1/2/4 processes with the same global batch: tokens/s, MFU, compile
time and peak memory, as a table (docs/train.md, "Proof").

    PYTHONPATH=python python benchmarks/bench_train.py [--preset small|tiny|llama-1b] [--procs 1,2,4]
        [--mesh fsdp,ddp] [--steps N] [--warmup N] [--peak-tflops X] [key=value ...]
    TORCH_PJRT_PLUGIN=cuda PYTHONPATH=python python benchmarks/bench_train.py --preset llama-1b --procs 1

Each row is one launch of the trainer's CLI (torchrun --standalone for more than one process; mesh.fsdp=N or
mesh.data=N) in fresh processes with the persistent compile cache off (TORCH_PJRT_CACHE_DIR empty), so the
compile numbers are cold. `key=value` arguments go to every launch after the preset's (steps, model.config.*, ...).

- tokens/s: global tokens per second over the steps after --warmup (the trainer's step_time_s column, rank 0).
- MFU: 6 x parameters x tokens/s / (peak FLOP/s x processes), the trainer's formula (logging.py; attention FLOPs
  not counted). The peak per chip is --peak-tflops, else the trainer's table entry for the device kind (H100/H200:
  989 dense bf16 TFLOP/s). The CPU plugin has no entry: the script measures the plugin's float32 matmul rate
  (2048x2048, one process, every core) as the machine's peak and gives each process an equal share, since the
  processes share the cores; MFU there means "of what the plugin's matmul reaches on this machine".
- first step s: time from fit() to the end of step 1 (rank 0: data, compiles, the step); to steady s: from fit()
  to the end of the last step that compiled a program (rank 0; the steps after it run cached programs);
  compiles: program compiles in the run (the most of any rank); compile s: rank 0's compiler seconds
  (torch_pjrt.metrics()["compile_seconds"]; compiles on several threads can add up to more than wall time).
- device MiB: torch.tpu.max_memory_allocated, the peak bytes of live tpu storages, the most of any rank. In fused
  mode (the default) a step's intermediates are storages that the recorded step graph holds until it runs, so this
  is the step's logical footprint with every intermediate live at once, more than the compiled program's buffers
  (XLA reuses them; an intermediate that does not leave the program gets no device buffer).
- RSS MiB: peak resident set size, the most of any rank; on the CPU plugin the device buffers are host memory, so
  this is the real peak (with torch, the plugin and the compiler).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRESETS = {
    # a small Llama on the generated text set: fits the CPU plugin in a few seconds a step
    "small": dict(steps=12, warmup=3, args=[
        "model.name=llama-tiny", "model.config.hidden_size=128", "model.config.intermediate_size=512",
        "model.config.num_hidden_layers=4", "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
        "data.source=TEXT", "data.seq_len=128", "data.global_batch=8", "precision=fp32"]),
    # the proof test's model and batch (tests/python/models/test_train_proof.py)
    "tiny": dict(steps=20, warmup=3, args=[
        "model.name=llama-tiny", "data.source=TEXT", "data.seq_len=32", "data.global_batch=16", "precision=fp32"]),
    # Llama 3.2 1B's shapes on synthetic tokens, bf16 autocast, torch.compile: for an H100/H200 (one process per GPU)
    "llama-1b": dict(steps=20, warmup=5, args=[
        "model.name=llama-1b", "data.source=synthetic", "data.num_samples=512", "data.seq_len=2048",
        "data.global_batch=8", "precision=bf16", "compile=true"]),
}
COMMON = ["optim.lr=1e-3", "optim.warmup_steps=2", "log.progress=false", "log.plot=false", "log.every=1"]


def _textset():
    """torch_pjrt/train/textset.py by its path: importing the package would start torch_pjrt in this process."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("textset", os.path.join(ROOT, "python", "torch_pjrt", "train",
                                                                          "textset.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(measure: bool) -> dict:
    """In a child process (a GPU client in this one would hold the device the launches need): the device kind,
    the trainer's peak for it, and with `measure` and no peak the plugin's float32 matmul TFLOP/s."""
    import torch
    import torch_pjrt  # noqa: F401
    from torch_pjrt.train.logging import peak_tflops
    name = torch.tpu.get_device_name()
    out = {"device": name, "devices": torch.tpu.device_count(), "peak_tflops": peak_tflops(name), "measured": False}
    if out["peak_tflops"] is None and measure:
        n, reps = 2048, 8
        a = torch.randn(n, n, device="tpu")
        bs = [torch.randn(n, n, device="tpu") for _ in range(reps)]  # distinct: XLA would merge equal products
        torch.tpu.synchronize()
        best = float("inf")
        for _ in range(4):  # the first compiles
            start = time.perf_counter()
            outs = [a @ b for b in bs]
            torch.tpu.synchronize()
            best = min(best, time.perf_counter() - start)
            del outs
        out.update(peak_tflops=2 * n ** 3 * reps / best / 1e12, measured=True)
    return out


def launch(procs: int, mesh: str, args: list[str], log_dir: str, timeout: int) -> dict:
    env = dict(os.environ, TORCH_PJRT_CACHE_DIR="", WANDB_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")] if p)
    mesh_args = [] if procs == 1 else [f"mesh.fsdp={procs}", "mesh.data=1"] if mesh == "fsdp" else \
        [f"mesh.data={procs}", "mesh.fsdp=1"]
    launcher = [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc-per-node={procs}"]
    cmd = launcher + ["-m", "torch_pjrt.train"] + args + mesh_args + [f"log.dir={log_dir}", "run_name=bench"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    summary = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("summary: "))[9:])
    with open(os.path.join(log_dir, "bench", "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return {"summary": summary, "rows": rows, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="key=value, after the preset's")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--procs", default="1,2,4")
    p.add_argument("--mesh", default="fsdp", help="fsdp and/or ddp (comma separated), for more than one process")
    p.add_argument("--steps", type=int, help="default: the preset's")
    p.add_argument("--warmup", type=int, help="steps left out of tokens/s; default: the preset's")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="peak per chip; default: the device kind's")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.probe:
        print(json.dumps(probe(measure=True)))
        return 0
    preset = PRESETS[a.preset]
    steps, warmup = a.steps or preset["steps"], a.warmup if a.warmup is not None else preset["warmup"]
    if steps <= warmup:
        p.error(f"--steps {steps} leaves no step after --warmup {warmup}")
    env = dict(os.environ, TORCH_PJRT_CACHE_DIR="")
    env["PYTHONPATH"] = os.pathsep.join(x for x in [os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")] if x)
    info = {"peak_tflops": a.peak_tflops, "measured": False, "device": "?", "devices": "?"} if a.peak_tflops else \
        json.loads(subprocess.run([sys.executable, os.path.abspath(__file__), "--probe"], env=env, capture_output=True,
                                  text=True, timeout=a.timeout, check=True).stdout.splitlines()[-1])
    cpu = info["measured"]
    print("command: PYTHONPATH=python python " + " ".join(["benchmarks/bench_train.py"] + sys.argv[1:]))
    print(f"device: {info['device']} ({info['devices']} per process), plugin: {os.environ.get('TORCH_PJRT_PLUGIN', 'cpu')}"
          f", host: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    if info["peak_tflops"] is None:
        print("peak: unknown (pass --peak-tflops); MFU n/a")
    elif cpu:
        print(f"peak: {1000 * info['peak_tflops']:.1f} GFLOP/s measured (float32 2048x2048 matmul on the plugin, one "
              f"process) for the whole machine; each of N processes gets 1/N")
    else:
        print(f"peak: {info['peak_tflops']:.0f} TFLOP/s per chip")
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        text = os.path.join(tmp, "text.txt")
        _textset().write_text_set(text, lines=400, seed=0)
        args = [x.replace("=TEXT", "=" + text) for x in preset["args"]] + COMMON + [f"steps={steps}"] + a.overrides
        print("trainer: " + " ".join(x.replace(text, "<text.txt>") for x in args))
        head = ("| procs | mesh | global batch x seq | tokens/s | MFU | first step s | to steady s | compiles | "
                "compile s | device MiB | RSS MiB | final loss |")
        table = [head, "|" + "---|" * (head.count("|") - 1)]
        for procs in [int(x) for x in a.procs.split(",")]:
            for mesh in (["-"] if procs == 1 else a.mesh.split(",")):
                peak = info["peak_tflops"]
                per_chip = None if peak is None else peak / procs if cpu else peak
                run_args = args + ([f"log.peak_tflops={per_chip}"] if per_chip else [])
                r = launch(procs, mesh, run_args, os.path.join(tmp, f"logs_{procs}_{mesh}"), a.timeout)
                steady = [row for row in r["rows"] if int(row["step"]) > warmup]
                seconds = sum(float(row["step_time_s"]) for row in steady)
                tokens = sum(float(row["tokens_per_s"]) * float(row["step_time_s"]) for row in steady)
                tps = tokens / seconds
                mfus = [float(row["mfu"]) * float(row["step_time_s"]) for row in steady if row["mfu"] not in ("", "None")]
                mfu = sum(mfus) / seconds if len(mfus) == len(steady) else None  # the trainer's, time-weighted
                s = r["summary"]
                last_compiling = max((i for i, row in enumerate(r["rows"]) if int(row["compiles"])), default=0)
                to_steady = sum(float(row["step_time_s"]) for row in r["rows"][: last_compiling + 1])
                batch = next(x for x in reversed(args) if x.startswith("data.global_batch=")).split("=")[1]
                seq = next(x for x in reversed(args) if x.startswith("data.seq_len=")).split("=")[1]
                print("BENCH " + json.dumps({"procs": procs, "mesh": mesh, "tokens_per_s": tps, "mfu": mfu,
                                             "to_steady_s": to_steady, "compiling_steps": [
                                                 int(row["step"]) for row in r["rows"] if int(row["compiles"])], **s,
                                             "final_loss": float(r["rows"][-1]["loss"]), "wall_s": r["wall_s"]}),
                      flush=True)
                table.append(f"| {procs} | {mesh} | {batch} x {seq} | {tps:,.0f} | "
                             f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {s['first_step_s']:.1f} | {to_steady:.1f} | "
                             f"{s['compiles']} | {s['compile_s']:.1f} | {s['peak_mem_bytes'] / 2**20:.1f} | "
                             f"{s['rss_peak_bytes'] / 2**20:.0f} | {float(r['rows'][-1]['loss']):.3f} |")
    print("\n".join(table))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
