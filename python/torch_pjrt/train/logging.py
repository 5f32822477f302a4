"""Metrics out of the trainer: a tqdm bar (loss, tokens/s, MFU), CSV, TensorBoard, W&B and a PNG plot.

Only rank 0 writes. MFU = 6 * parameters * tokens/s / (peak FLOP/s of the chips); the peak comes
from log.peak_tflops or the device kind's table entry, and is "n/a" when neither knows it (the CPU
plugin): no made-up number.
"""
from __future__ import annotations

import csv
import os

__all__ = ["PEAK_TFLOPS", "peak_tflops", "MetricsLogger", "read_csv_rows"]

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
    # device's peak bytes allocated so far (torch.tpu.max_memory_allocated); eval_loss, eval_ppl: the held-out
    # loss and its perplexity, on the rows where an evaluation ran (eval.every)
    FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "compiles", "compile_s",
              "peak_mem_bytes", "eval_loss", "eval_ppl")

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
            self._open_csv(os.path.join(run_dir, "metrics.csv"), first_step)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if cfg.wandb != "off":
            import wandb
            self._wandb = wandb.init(project=cfg.wandb_project, dir=run_dir, mode=cfg.wandb, config=config_dict,
                                     name=os.path.basename(run_dir), reinit="finish_previous")

    def _open_csv(self, path: str, first_step: int) -> None:
        """A resumed run (first_step > 0) keeps the earlier rows up to its checkpoint's step: rows after it are
        from an attempt that did not reach a checkpoint, and this run logs those steps again. The file is
        rewritten with this version's columns (an older file may lack some)."""
        earlier = [r for r in read_csv_rows(path) if r["step"] <= first_step] if first_step else []
        self._csv_file = open(path, "w", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.FIELDS)
        self._csv.writeheader()
        for row in earlier:
            self._write_csv_row(row)
        self._csv_file.flush()

    def _write_csv_row(self, row: dict) -> None:
        # repr: the float32 loss round-trips exactly (the resume test compares these bitwise)
        self._csv.writerow({k: repr(row[k]) if isinstance(row.get(k), float) else row.get(k, "") for k in self.FIELDS})

    def log(self, row: dict) -> None:
        self.history.append(row)
        if not self.enabled:
            return
        if self._csv is not None:
            self._write_csv_row(row)
            self._csv_file.flush()
        numbers = {_scalar_name(k): v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, row["step"])
        if self._wandb is not None:
            self._wandb.log(numbers, step=row["step"])
        if self._bar is not None:
            mfu = row.get("mfu")
            self._bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                  mfu="n/a" if mfu is None else f"{100 * mfu:.1f}%", refresh=False)
            self._bar.update(row["step"] - self._bar.n)
        if row.get("eval_loss") is not None:
            self._print(f"step {row['step']}: eval loss {row['eval_loss']:.4f}, perplexity {row['eval_ppl']:.3f}")

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)  # above the bar, which stays at the bottom
        else:
            print(line, flush=True)

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

    def plot_rows(self) -> list[dict]:
        """The rows the plot shows: the whole run from metrics.csv (after a resume, the earlier processes' rows
        too), or this process's rows when there is no CSV."""
        path = os.path.join(self.run_dir, "metrics.csv")
        return read_csv_rows(path) if self.cfg.csv else list(self.history)

    def plot(self, path: str) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = self.plot_rows()
        steps = [r["step"] for r in rows]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.plot(steps, [r["loss"] for r in rows], label="train")
        evals = [r for r in rows if r.get("eval_loss") is not None]
        if evals:
            a.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
            a.legend()
        a.set_xlabel("step"), a.set_ylabel("loss"), a.set_title("loss")
        b.plot(steps, [r["tokens_per_s"] for r in rows])
        b.set_xlabel("step"), b.set_ylabel("tokens/s"), b.set_title("throughput")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


def _scalar_name(key: str) -> str:
    """TensorBoard / W&B tag: eval_loss -> eval/loss, eval_ppl -> eval/perplexity, loss -> train/loss."""
    if key.startswith("eval_"):
        return "eval/" + {"ppl": "perplexity"}.get(key[5:], key[5:])
    return f"train/{key}"


def read_csv_rows(path: str) -> list[dict]:
    """metrics.csv's rows, numbers parsed (step as int, empty cells as None); [] without a file."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [{k: _number(k, v) for k, v in r.items()} for r in rows]


def _number(key: str, text: str | None):
    if text in (None, "", "None"):
        return None
    return int(text) if key in ("step", "compiles", "peak_mem_bytes") else float(text)
