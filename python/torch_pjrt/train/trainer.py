"""Trainer: a small config-driven causal-LM training loop on the `tpu` device; subclass and override
build_model / build_data / build_optimizer / compute_loss / train_step / save_checkpoint /
load_checkpoint / export to change one part.

    Trainer(load_config("run.yaml", ["steps=200"])).fit()

Resume is bitwise: a checkpoint holds the model and optimizer (torch.distributed.checkpoint, sharded
as trained), and per rank the scheduler, the step, the data position and the CPU and tpu RNG states.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist

import torch_pjrt  # noqa: F401  (registers the tpu device)

from . import mesh as M
from .config import ConfigError, TrainConfig, resume_differences, to_dict
from .data import ResumableBatches, build_dataset, hf_tokenizer, split_held_out
from .logging import MetricsLogger, peak_tflops

__all__ = ["Trainer", "PRESETS", "make_model"]

PRESETS = {
    "llama-tiny": ("LlamaConfig", dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)),
    "gpt2-tiny": ("GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=256)),
    # Llama 3.2 1B's shapes (1.24e9 parameters, tied embeddings), random init: benchmarks/bench_train.py --preset llama-1b
    "llama-1b": ("LlamaConfig", dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                     max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True)),
}


def make_model(cfg) -> torch.nn.Module:
    """cfg: the ModelConfig. On the current default device (the CPU, or meta)."""
    name, extra = cfg.name, dict(cfg.config)
    if ":" in name and not os.path.exists(name):
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"config key 'model.name': cannot import {name!r}: {e}") from e
        return factory(**extra)
    import transformers
    if name in PRESETS:
        cls, base = PRESETS[name]
        config = getattr(transformers, cls)(**{**base, **extra})
    elif os.path.exists(name):
        config = transformers.AutoConfig.from_pretrained(name, local_files_only=True, **extra)
    else:
        raise ConfigError(f"config key 'model.name': {name!r} is no preset ({', '.join(PRESETS)}), local path "
                          f"or module:callable")
    return transformers.AutoModelForCausalLM.from_config(config)


def _rss_peak_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _local_slice(full, dt):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(full.shape, dt.device_mesh, dt.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, also for a model whose parameters are partly DTensors (tensor-parallel rules
    on some weights, the rest plain), which it refuses ("mixed torch.Tensor and DTensor"): the two groups' norms
    are taken apart and combined, and every gradient is scaled through its local tensor (scaling commutes with
    any placement)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    sharded = [p.grad for p in params if isinstance(p.grad, DTensor)]
    plain = [p.grad for p in params if not isinstance(p.grad, DTensor)]
    if not sharded or not plain:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = [torch.nn.utils.get_total_norm(plain), torch.nn.utils.get_total_norm(sharded).full_tensor()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(plain + [g.to_local() for g in sharded], coef)
    return total


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        M.init_distributed()
        self.rank, self.world_size = M.world()
        self.shape = M.mesh_shape(cfg, self.world_size)
        data, fsdp, tp = self.shape
        if data > 1 and fsdp == 1 and tp > 1:
            raise ConfigError("config key 'mesh.fsdp': data parallel with tensor parallel needs fsdp >= 2 (HSDP)")
        self.dp_size, self.dp_rank = data * fsdp, self.rank // tp
        micro_global = cfg.data.global_batch // cfg.data.grad_accum
        if micro_global * cfg.data.grad_accum != cfg.data.global_batch or micro_global % self.dp_size:
            raise ConfigError(f"config key 'data.global_batch': {cfg.data.global_batch} is not data.grad_accum="
                              f"{cfg.data.grad_accum} x a multiple of the {self.dp_size} data-parallel ranks")
        self.micro_global = micro_global
        self.device = torch.device("tpu")
        self.mesh = M.build_mesh(self.shape)
        torch.manual_seed(cfg.seed)
        torch.tpu.manual_seed(cfg.seed)
        self.model = self.build_model()  # the module that owns the parameters (state dicts, export)
        self.forward_model = torch.compile(self.model, backend="tpu") if cfg.compile else self.model
        self.optimizer = self.build_optimizer()
        self.scheduler = self.build_scheduler()
        self.step, self.micro_done = 0, 0  # optimizer steps done; global micro-batches consumed
        self.resumed_from = self.load_checkpoint() if cfg.checkpoint.dir and cfg.checkpoint.resume else None
        self.loader = self.build_data()
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.summary: dict = {}  # after fit(): time to the first step, compiles, peak memory (max over ranks)
        self.logger = None  # fit()'s MetricsLogger (its plot_rows: the whole run's rows)

    # ---- building -------------------------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        cfg = self.cfg.model
        model = make_model(cfg)  # on the CPU: the same initial values whatever the mesh
        if cfg.init_from:
            from safetensors.torch import load_file
            model.load_state_dict(load_file(os.path.join(cfg.init_from, "model.safetensors")), strict=False)
        self.vocab_size = getattr(getattr(model, "config", None), "vocab_size", None) or cfg.config.get("vocab_size", 256)
        if self.mesh is None or self.shape[1:] == (1, 1):
            M.apply_activation_checkpointing(model, cfg.activation_checkpointing)
            model.to(self.device)
            if self.mesh is not None:  # data parallel only
                model = torch.nn.parallel.DistributedDataParallel(model)
            return model
        values = dict(model.named_parameters()) | dict(model.named_buffers())
        with torch.device("meta"):
            torch.manual_seed(self.cfg.seed)
            shell = make_model(cfg)
        M.apply_activation_checkpointing(shell, cfg.activation_checkpointing)
        M.parallelize(shell, self.mesh, self.cfg.mesh.rules)
        shell.to_empty(device=self.device)
        from torch.distributed.tensor import DTensor
        with torch.no_grad():
            for name, t in list(shell.named_parameters()) + list(shell.named_buffers()):
                if isinstance(t, DTensor):
                    t.to_local().copy_(_local_slice(values[name], t))
                else:
                    t.copy_(values[name])
        return shell

    @property
    def raw_model(self):
        return self.model.module if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) else self.model

    def build_data(self):
        """The training batches' iterator; with eval.every, the held-out rows are split off first
        (self.eval_batches) and never reach the sampler."""
        cfg = self.cfg.data
        dataset = build_dataset(cfg, self.vocab_size)
        self.eval_batches = []
        if self.cfg.eval.every:
            dataset, held_out = split_held_out(dataset, self.cfg.eval.fraction)
            self.eval_batches = self.held_out_batches(held_out)
        sampler = ResumableBatches(len(dataset), self.micro_global, self.dp_rank, self.dp_size, self.cfg.seed,
                                   start=self.micro_done)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.num_workers)
        return iter(torch_pjrt.DeviceLoader(loader, self.device, prefetch=cfg.prefetch))

    def held_out_batches(self, held_out) -> list[torch.Tensor]:
        """This rank's slices of the held-out rows in order, global micro-batches as in training (a tail that
        does not fill one is left out), at most eval.batches of them."""
        m, local = self.micro_global, self.micro_global // self.dp_size
        count = len(held_out) // m
        if count == 0:
            raise ConfigError(f"config key 'eval.fraction': {len(held_out)} held-out rows, fewer than one micro-batch "
                              f"of {m} (data.global_batch / data.grad_accum)")
        if self.cfg.eval.batches:
            count = min(count, self.cfg.eval.batches)
        starts = (k * m + self.dp_rank * local for k in range(count))
        return [torch.stack([held_out[i] for i in range(first, first + local)]) for first in starts]

    def build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optim
        params = [p for p in self.model.parameters() if p.requires_grad]
        # Tensor-parallel rules on some weights leave the rest plain tensors: the foreach kernels refuse a mix
        # of DTensors and tensors, so such a model steps parameter by parameter (None: PyTorch's default).
        from torch.distributed.tensor import DTensor
        mixed = len({isinstance(p, DTensor) for p in params}) > 1
        foreach = False if mixed else None
        if o.name == "sgd":
            return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, foreach=foreach)
        return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                 foreach=foreach)

    def build_scheduler(self):
        o, total = self.cfg.optim, self.cfg.steps

        def factor(step):
            if step < o.warmup_steps:
                return (step + 1) / o.warmup_steps
            if o.schedule == "constant":
                return 1.0
            frac = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
            shape = 1 - frac if o.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
            return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape
        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)

    # ---- one step -------------------------------------------------------------------------------------
    def compute_loss(self, batch: torch.Tensor) -> torch.Tensor:
        out = self.forward_model(input_ids=batch, labels=batch) if hasattr(self.raw_model, "config") else self.forward_model(batch)
        if getattr(out, "loss", None) is not None:
            return out.loss
        logits = getattr(out, "logits", out)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    def train_step(self) -> dict:
        accum = self.cfg.data.grad_accum
        total = None
        for _ in range(accum):
            batch = next(self.loader)
            with torch.autocast("tpu", dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
                loss = self.compute_loss(batch) / accum
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            self.micro_done += 1
        grad_norm = None
        if self.cfg.optim.grad_clip > 0:
            grad_norm = clip_grad_norm(self.model.parameters(), self.cfg.optim.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": total, "grad_norm": grad_norm, "lr": lr}

    def evaluate(self) -> dict:
        """The mean loss over the held-out micro-batches and its perplexity, in eval mode without gradients;
        the model goes back to train mode."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        try:
            with torch.no_grad():
                for batch in self.eval_batches:
                    with torch.autocast("tpu", dtype=torch.bfloat16, enabled=self.cfg.precision == "bf16"):
                        total += self.compute_loss(batch.to(self.device)).float()
        finally:
            self.model.train()
        loss = self._reduce_loss(total / len(self.eval_batches))
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}  # exp overflows a float past ~709

    def _reduce_loss(self, loss: torch.Tensor) -> float:
        if self.world_size > 1:  # every dp group's mean is the global batch's mean (equal slices)
            loss = loss.clone()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss.item()

    # ---- the loop -------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        cfg = self.cfg
        end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
        if self.step >= end:
            self._say_nothing_to_train(end)
            return []
        run_dir = os.path.join(cfg.log.dir, cfg.run_name)
        logger = self.logger = MetricsLogger(cfg.log, run_dir, cfg.steps, self.step, self.rank == 0, to_dict(cfg))
        peak = peak_tflops(torch.tpu.get_device_name(), cfg.log.peak_tflops)
        tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        start_metrics = last_metrics = torch_pjrt.metrics()
        t0, since = time.perf_counter(), self.step
        fit_start, first_step_s = t0, None
        try:
            while self.step < end:
                out = self.train_step()
                eval_now = cfg.eval.every and (self.step % cfg.eval.every == 0 or self.step == cfg.steps)
                if self.step % cfg.log.every == 0 or self.step == end or eval_now:
                    loss = self._reduce_loss(out["loss"])
                    now = time.perf_counter()
                    first_step_s = now - fit_start if first_step_s is None else first_step_s
                    dt = (now - t0) / (self.step - since)
                    tps = tokens_per_step / dt
                    norm = out["grad_norm"]
                    if norm is not None:
                        norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
                    mfu = None if peak is None else 6 * self.n_params * tps / (peak * 1e12 * self.world_size)
                    m = torch_pjrt.metrics()  # this process's compiles since the last row
                    row = {"step": self.step, "loss": loss, "lr": out["lr"], "grad_norm": norm,
                           "tokens_per_s": tps, "mfu": mfu, "step_time_s": dt,
                           "compiles": m["compiles"] - last_metrics["compiles"],
                           "compile_s": m["compile_seconds"] - last_metrics["compile_seconds"],
                           "peak_mem_bytes": torch.tpu.max_memory_allocated()}
                    if eval_now:
                        row.update(self.evaluate())
                        now = time.perf_counter()  # the next row's step time leaves the evaluation out
                    logger.log(row)
                    t0, since, last_metrics = now, self.step, m
                if cfg.checkpoint.dir and cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0:
                    self.save_checkpoint()
            if cfg.checkpoint.dir and (not cfg.checkpoint.every or self.step % cfg.checkpoint.every):
                self.save_checkpoint()
            if cfg.checkpoint.export and self.step == cfg.steps:
                self.export(cfg.checkpoint.export)
        finally:
            logger.close()
        m = torch_pjrt.metrics()
        # the slowest rank's compiles and memory (every rank calls this: the loop above ran on all of them)
        worst = torch.tensor([m["compiles"] - start_metrics["compiles"], torch.tpu.max_memory_allocated(),
                              _rss_peak_bytes()], dtype=torch.int64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        compiles, peak_mem, rss = worst.tolist()
        self.summary = {"first_step_s": first_step_s, "compiles": compiles,
                        "compile_s": m["compile_seconds"] - start_metrics["compile_seconds"],
                        "disk_cache_hits": m["disk_cache_hits"] - start_metrics["disk_cache_hits"],
                        "peak_mem_bytes": peak_mem, "rss_peak_bytes": rss}
        return logger.history

    def _say_nothing_to_train(self, end: int) -> None:
        if self.rank != 0:
            return
        where = f"checkpoint {self.resumed_from} is at step {self.step}"
        if self.step >= self.cfg.steps:
            print(f"run already finished: {where}, steps={self.cfg.steps}; nothing to train (raise steps to train "
                  f"on, or set a new checkpoint.dir to start a new run)", flush=True)
        else:
            print(f"nothing to train: {where}, stop_after={end} (raise stop_after, or set it to 0 to train to "
                  f"steps={self.cfg.steps})", flush=True)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def _ckpt_dir(self, step: int) -> str:
        return os.path.join(self.cfg.checkpoint.dir, f"step_{step:08d}")

    def complete_checkpoints(self) -> list[str]:
        """The checkpoint directories that hold a DONE marker, oldest first."""
        root = self.cfg.checkpoint.dir
        if not os.path.isdir(root):
            return []
        done = sorted(d for d in os.listdir(root) if d.startswith("step_") and os.path.exists(os.path.join(root, d, "DONE")))
        return [os.path.join(root, d) for d in done]

    def latest_checkpoint(self) -> str | None:
        done = self.complete_checkpoints()
        return done[-1] if done else None

    def _prune_checkpoints(self) -> None:
        """checkpoint.keep: the newest `keep` complete checkpoints stay (incomplete ones are left alone: a
        checkpoint being written by another attempt is not ours to delete)."""
        keep = self.cfg.checkpoint.keep
        for old in self.complete_checkpoints()[:-keep] if keep else []:
            shutil.rmtree(old, ignore_errors=True)

    def _barrier(self):
        if self.world_size > 1:
            dist.barrier()

    def save_checkpoint(self) -> str:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        path = self._ckpt_dir(self.step)
        model_sd, optim_sd = get_state_dict(self.raw_model, self.optimizer)
        with warnings.catch_warnings():  # one process without a process group is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        torch.save({"step": self.step, "micro_done": self.micro_done, "scheduler": self.scheduler.state_dict(),
                    "cpu_rng": torch.get_rng_state(), "tpu_rng": torch.tpu.get_rng_state()},
                   os.path.join(path, f"trainer_rank{self.rank}.pt"))
        self._barrier()
        if self.rank == 0:
            with open(os.path.join(path, "config.json"), "w") as f:  # what a resume is checked against
                json.dump(to_dict(self.cfg), f, indent=1)
            open(os.path.join(path, "DONE"), "w").close()  # only complete checkpoints are resumed
            self._prune_checkpoints()
        self._barrier()
        return path

    def load_checkpoint(self, path: str | None = None) -> str | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        path = path or self.latest_checkpoint()
        if path is None:
            return None
        self._check_resumable(path)
        model_sd, optim_sd = get_state_dict(self.raw_model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path)
        set_state_dict(self.raw_model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(self._rank_state_file(path), weights_only=True)
        self.step, self.micro_done = extra["step"], extra["micro_done"]
        self.scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["cpu_rng"])
        torch.tpu.set_rng_state(extra["tpu_rng"])
        torch.tpu.synchronize()
        return path

    def _check_resumable(self, path: str) -> None:
        """Refuses a checkpoint whose run differs from this config in what shapes training (config.RESUME_MUST_MATCH):
        re-running with another config on the same checkpoint.dir would otherwise continue the old run silently."""
        saved = os.path.join(path, "config.json")
        if self.cfg.checkpoint.force_resume or not os.path.exists(saved):  # older checkpoints have no config
            return
        with open(saved) as f:
            differences = resume_differences(json.load(f), self.cfg)
        if differences:
            raise ConfigError(f"checkpoint.dir {self.cfg.checkpoint.dir!r} holds a run whose settings differ from this "
                              f"config ({os.path.basename(path)}): {'; '.join(differences)}. Set a new checkpoint.dir "
                              f"to start this run afresh, or checkpoint.force_resume=true to continue that run with "
                              f"these settings.")

    def _rank_state_file(self, path: str) -> str:
        """This rank's trainer state on the mesh size that saved it (bitwise resume); on another world size rank
        0's for every rank: the step, the data position and the schedule are global, and every rank seeded its
        RNGs alike (the per-rank files differ only if a model draws random numbers differently per rank)."""
        saved = sum(1 for f in os.listdir(path) if f.startswith("trainer_rank") and f.endswith(".pt"))
        return os.path.join(path, f"trainer_rank{self.rank if saved == self.world_size else 0}.pt")

    # ---- export ---------------------------------------------------------------------------------------
    def full_state_dict(self) -> dict:
        """Every rank calls it (collectives); full CPU tensors on rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(self.raw_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def export(self, out_dir: str) -> None:
        """HF layout: model.safetensors + config.json (AutoModelForCausalLM.from_pretrained loads it on the CPU),
        and the tokenizer of text data (AutoTokenizer.from_pretrained loads it from the same directory)."""
        state = self.full_state_dict()
        if self.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            raw = self.raw_model
            if hasattr(raw, "save_pretrained"):
                cpu = type(raw)(raw.config)
                cpu.load_state_dict(state)
                cpu.save_pretrained(out_dir, safe_serialization=True)
            else:
                from safetensors.torch import save_file
                save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"))
            if self.cfg.data.source != "synthetic":  # synthetic ids are no text: no tokenizer means them
                hf_tokenizer(self.cfg.data.tokenizer).save_pretrained(out_dir)
        self._barrier()

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
