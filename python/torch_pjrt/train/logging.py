"""Metrics out of the trainer: a tqdm bar (loss, tokens/s, MFU), CSV, TensorBoard, W&B and a PNG plot.

Only rank 0 writes. MFU = 6 * parameters * tokens/s / (peak FLOP/s of the chips); the peak comes
from log.peak_tflops or the device kind's table entry, and is "n/a" when neither knows it (the CPU
plugin): no made-up number.
"""
from __future__ import annotations

import csv
import os

__all__ = ["PEAK_TFLOPS", "peak_tflops", "MetricsLogger"]

# Dense bf16 peak TFLOP/s per chip (vendor figures).
PEAK_TFLOPS = {
    "h100": 989.0, "h200": 989.0, "a100": 312.0,
    "tpu v4": 275.0, "tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v5p": 459.0, "tpu v5": 459.0,
    "tpu v6 lite": 918.0, "tpu v6e": 918.0,
}


def peak_tflops(device_kind: str, configured: float = 0.0) -> float | None:
    if configured > 0:
        return configured
    kind = device_kind.lower()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "tpu v5 lite" before "tpu v5"
        if key in kind:
            return PEAK_TFLOPS[key]
    return None


class MetricsLogger:
    # compiles, compile_s: this process's program compiles since the previous row; peak_mem_bytes: the tpu
    # device's peak bytes allocated so far (torch.tpu.max_memory_allocated)
    FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "compiles", "compile_s",
              "peak_mem_bytes")

    def __init__(self, cfg, run_dir: str, total_steps: int, first_step: int, enabled: bool, config_dict: dict):
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.history: list[dict] = []
        self._bar = self._csv = self._csv_file = self._tb = self._wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if cfg.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=first_step, desc="train", dynamic_ncols=True)
        if cfg.csv:
            path = os.path.join(run_dir, "metrics.csv")
            new = first_step == 0 or not os.path.exists(path)
            self._csv_file = open(path, "w" if new else "a", newline="")
            self._csv = csv.DictWriter(self._csv_file, fieldnames=self.FIELDS)
            if new:
                self._csv.writeheader()
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if cfg.wandb != "off":
            import wandb
            self._wandb = wandb.init(project=cfg.wandb_project, dir=run_dir, mode=cfg.wandb, config=config_dict,
                                     name=os.path.basename(run_dir), reinit="finish_previous")

    def log(self, row: dict) -> None:
        self.history.append(row)
        if not self.enabled:
            return
        if self._csv is not None:
            # repr: the float32 loss round-trips exactly (the resume test compares these bitwise)
            self._csv.writerow({k: repr(row[k]) if isinstance(row.get(k), float) else row.get(k, "") for k in self.FIELDS})
            self._csv_file.flush()
        numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(f"train/{k}", v, row["step"])
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in numbers.items()}, step=row["step"])
        if self._bar is not None:
            mfu = row.get("mfu")
            self._bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                  mfu="n/a" if mfu is None else f"{100 * mfu:.1f}%", refresh=False)
            self._bar.update(row["step"] - self._bar.n)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._csv_file is not None:
            self._csv_file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self.cfg.plot and self.history:
            self.plot(os.path.join(self.run_dir, "plot.png"))

    def plot(self, path: str) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        steps = [r["step"] for r in self.history]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(steps, [r["loss"] for r in self.history])
        a.set_xlabel("step"), a.set_ylabel("loss"), a.set_title("loss")
        b.plot(steps, [r["tokens_per_s"] for r in self.history])
        b.set_xlabel("step"), b.set_ylabel("tokens/s"), b.set_title("throughput")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
