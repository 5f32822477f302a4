"""The trainer's configuration: nested dataclasses, loaded from YAML and `key=value` overrides.

    cfg = load_config("run.yaml", ["optim.lr=3e-4", "mesh.fsdp=2"])

Every key is checked against the dataclasses: an unknown or mistyped key, a value of the wrong
type or outside its choices raises ConfigError naming the full key (and the nearest valid one).
Fields typed `dict` take free keys below them (`model.config.num_hidden_layers=4`,
`mesh.rules.*.q_proj.weight=colwise`).
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field

import yaml

__all__ = ["ConfigError", "TrainConfig", "load_config", "apply_override", "to_dict", "reference_markdown",
           "resume_differences"]


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


def _choices(*names):
    return {"choices": names}


@dataclass
class ModelConfig:
    name: str = field(default="llama-tiny", metadata={"doc": "a preset (llama-tiny, gpt2-tiny, llama-1b), a local HF config "
                                                             "directory or config.json, or `module:callable` returning an nn.Module"})
    config: dict = field(default_factory=dict, metadata={"doc": "fields set on the HF config (num_hidden_layers, ...)"})
    activation_checkpointing: str = field(default="none", metadata={
        "doc": "recompute layers in backward: none, all, or every:N (every Nth layer)"})
    init_from: str = field(default="", metadata={"doc": "an exported directory whose weights start the run"})


@dataclass
class DataConfig:
    source: str = field(default="synthetic", metadata={"doc": "synthetic, or local text/jsonl file(s) (comma separated, globs)"})
    text_field: str = field(default="text", metadata={"doc": "the jsonl field holding the text"})
    tokenizer: str = field(default="byte", metadata={"doc": "byte (256 ids), or a local HF tokenizer directory"})
    seq_len: int = field(default=32, metadata={"doc": "tokens per sample"})
    global_batch: int = field(default=8, metadata={"doc": "samples per optimizer step over all data-parallel ranks"})
    grad_accum: int = field(default=1, metadata={"doc": "micro-batches per optimizer step"})
    num_samples: int = field(default=4096, metadata={"doc": "size of the synthetic set"})
    num_workers: int = field(default=0, metadata={"doc": "DataLoader worker processes"})
    prefetch: int = field(default=2, metadata={"doc": "batches uploaded ahead by torch_pjrt.DeviceLoader"})


@dataclass
class OptimConfig:
    name: str = field(default="adamw", metadata={"doc": "adamw or sgd", **_choices("adamw", "sgd")})
    lr: float = field(default=1e-3, metadata={"doc": "peak learning rate"})
    weight_decay: float = field(default=0.0, metadata={"doc": "decoupled weight decay (adamw) / L2 (sgd)"})
    betas: list = field(default_factory=lambda: [0.9, 0.95], metadata={"doc": "adamw betas"})
    eps: float = field(default=1e-8, metadata={"doc": "adamw eps"})
    momentum: float = field(default=0.0, metadata={"doc": "sgd momentum"})
    schedule: str = field(default="cosine", metadata={"doc": "constant, linear or cosine decay after warmup",
                                                      **_choices("constant", "linear", "cosine")})
    warmup_steps: int = field(default=0, metadata={"doc": "linear warmup steps"})
    min_lr_ratio: float = field(default=0.1, metadata={"doc": "final lr as a fraction of lr (linear, cosine)"})
    grad_clip: float = field(default=1.0, metadata={"doc": "max global gradient norm; 0 turns clipping off"})


@dataclass
class MeshConfig:
    data: int = field(default=-1, metadata={"doc": "replicas (DDP, or HSDP's outer axis with fsdp > 1); -1: what "
                                                   "the world size leaves"})
    fsdp: int = field(default=1, metadata={"doc": "ranks each parameter is sharded over (FSDP2, per layer)"})
    tensor: int = field(default=1, metadata={"doc": "tensor-parallel ranks (DTensor, by `rules`)"})
    rules: dict = field(default_factory=dict, metadata={
        "doc": "parameter-name wildcard -> colwise, rowwise or replicate (tensor parallel); empty: the model's preset"})


@dataclass
class CheckpointConfig:
    dir: str = field(default="", metadata={"doc": "torch.distributed.checkpoint directory ('' : none)"})
    every: int = field(default=0, metadata={"doc": "save every N steps (and at the end); 0: at the end only"})
    resume: bool = field(default=True, metadata={"doc": "continue from the newest checkpoint in dir"})
    force_resume: bool = field(default=False, metadata={
        "doc": "resume even when the checkpoint's run differs in model, precision, seed, optim, data or eval split"})
    keep: int = field(default=0, metadata={"doc": "keep the newest N checkpoints, delete older ones; 0: keep all"})
    export: str = field(default="", metadata={"doc": "write HF safetensors + config.json here at the end"})


@dataclass
class EvalConfig:
    every: int = field(default=0, metadata={"doc": "evaluate every N steps and at the end; 0: off (no held-out split)"})
    fraction: float = field(default=0.05, metadata={
        "doc": "share of the data's rows held out for evaluation (the last ones), when every > 0"})
    batches: int = field(default=0, metadata={"doc": "micro-batches per evaluation; 0: the whole held-out set"})


@dataclass
class LogConfig:
    dir: str = field(default="runs", metadata={"doc": "CSV, TensorBoard, W&B and the plot go to dir/run_name"})
    every: int = field(default=1, metadata={"doc": "log every N steps"})
    progress: bool = field(default=True, metadata={"doc": "tqdm progress bar (rank 0)"})
    csv: bool = field(default=True, metadata={"doc": "metrics.csv"})
    tensorboard: bool = field(default=False, metadata={"doc": "TensorBoard event files"})
    wandb: str = field(default="off", metadata={"doc": "off, offline or online", **_choices("off", "offline", "online")})
    wandb_project: str = field(default="torch_pjrt", metadata={"doc": "W&B project"})
    plot: bool = field(default=True, metadata={"doc": "plot.png of loss and tokens/s at the end"})
    peak_tflops: float = field(default=0.0, metadata={"doc": "peak TFLOP/s per chip for MFU; 0: by device kind"})


@dataclass
class LaunchConfig:
    kind: str = field(default="tpu", metadata={"doc": "tpu (slice) or gpu (node pool)", **_choices("tpu", "gpu")})
    image: str = field(default="torch-pjrt:latest", metadata={"doc": "container image with torch and torch_pjrt"})
    nodes: int = field(default=1, metadata={"doc": "hosts (per slice on tpu)"})
    procs_per_node: int = field(default=1, metadata={"doc": "processes per host = chips (GPUs) per host"})
    slices: int = field(default=1, metadata={"doc": "TPU slices (multislice)"})
    tpu_accelerator: str = field(default="tpu-v5p-slice", metadata={"doc": "cloud.google.com/gke-tpu-accelerator"})
    tpu_topology: str = field(default="2x2x1", metadata={"doc": "cloud.google.com/gke-tpu-topology"})
    gpu_accelerator: str = field(default="nvidia-h100-80gb", metadata={"doc": "cloud.google.com/gke-accelerator"})
    namespace: str = field(default="default", metadata={"doc": "Kubernetes namespace"})
    cache_claim: str = field(default="torch-pjrt-cache", metadata={
        "doc": "PersistentVolumeClaim (ReadWriteMany) for the compile cache and checkpoints"})
    port: int = field(default=29500, metadata={"doc": "torchrun rendezvous port"})


@dataclass
class TrainConfig:
    run_name: str = field(default="run", metadata={"doc": "names the log directory and the Kubernetes JobSet"})
    seed: int = field(default=0, metadata={"doc": "model init, data order and dropout"})
    steps: int = field(default=100, metadata={"doc": "optimizer steps (the schedule's length)"})
    stop_after: int = field(default=0, metadata={"doc": "end this run after this step (a later run resumes); 0: steps"})
    precision: str = field(default="fp32", metadata={"doc": "fp32, or bf16 (autocast; fp32 weights)", **_choices("fp32", "bf16")})
    compile: bool = field(default=False, metadata={"doc": "torch.compile(backend='tpu') the model"})
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


def _nearest(name, options, prefix):
    near = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean '{prefix}{near[0]}'?)" if near else f" (valid: {', '.join(sorted(options))})"


def _coerce(value, tp, key, f):
    """value (from YAML or a parsed override) checked and converted to the field's type."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if value is False and "off" in f.metadata.get("choices", ()):
            value = "off"  # YAML 1.1 reads a bare `off` as false
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = str(value)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(choices)}")
            return value
    elif tp is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    elif tp is dict:
        if isinstance(value, dict):
            return dict(value)
    raise ConfigError(f"config key '{key}': expected {tp.__name__}, got {value!r}")


def _fields(obj):
    hints = typing.get_type_hints(type(obj))
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(obj)}


def _merge(obj, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, got {data!r}")
    fields = _fields(obj)
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}'" + _nearest(str(name), fields, prefix))
        f, tp = fields[name]
        if dataclasses.is_dataclass(tp):
            _merge(getattr(obj, name), value or {}, key + ".")
        else:
            setattr(obj, name, _coerce(value, tp, key, f))


def apply_override(cfg: TrainConfig, item: str) -> None:
    """`a.b.c=value`: the value is parsed as YAML (numbers, bools, lists) and checked like a file's."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value")
    key, text = item.split("=", 1)
    value = yaml.safe_load(text) if text.strip() else ""
    parts = key.strip().split(".")
    obj, prefix = cfg, ""
    for i, name in enumerate(parts):
        fields = _fields(obj)
        if name not in fields:
            raise ConfigError(f"unknown config key '{prefix}{name}'" + _nearest(name, fields, prefix))
        f, tp = fields[name]
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                _merge(getattr(obj, name), value, prefix + name + ".")
                return
            obj, prefix = getattr(obj, name), prefix + name + "."
        elif tp is dict and i < len(parts) - 1:  # free keys below a dict field (they may hold dots)
            getattr(obj, name)[".".join(parts[i + 1:])] = value
            return
        elif i < len(parts) - 1:
            raise ConfigError(f"config key '{prefix}{name}' has no sub-keys (got '{key}')")
        else:
            if tp is str and not isinstance(value, str) and value is not None:
                value = text.strip()  # e.g. run_name=007 stays the string written
            setattr(obj, name, _coerce(value, tp, prefix + name, f))
            return


def validate(cfg: TrainConfig) -> None:
    """Checks across keys, each error naming the key."""
    positive = {"steps": cfg.steps, "data.seq_len": cfg.data.seq_len, "data.global_batch": cfg.data.global_batch,
                "data.grad_accum": cfg.data.grad_accum, "data.prefetch": cfg.data.prefetch, "log.every": cfg.log.every,
                "mesh.fsdp": cfg.mesh.fsdp, "mesh.tensor": cfg.mesh.tensor, "launch.nodes": cfg.launch.nodes,
                "launch.procs_per_node": cfg.launch.procs_per_node, "launch.slices": cfg.launch.slices}
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}': must be >= 1, got {value}")
    for key, value in {"stop_after": cfg.stop_after, "checkpoint.every": cfg.checkpoint.every,
                       "checkpoint.keep": cfg.checkpoint.keep, "eval.every": cfg.eval.every,
                       "eval.batches": cfg.eval.batches,
                       "data.num_workers": cfg.data.num_workers, "optim.warmup_steps": cfg.optim.warmup_steps}.items():
        if value < 0:
            raise ConfigError(f"config key '{key}': must be >= 0, got {value}")
    if cfg.mesh.data == 0 or cfg.mesh.data < -1:
        raise ConfigError(f"config key 'mesh.data': must be >= 1 or -1, got {cfg.mesh.data}")
    if cfg.eval.every and not 0 < cfg.eval.fraction < 1:
        raise ConfigError(f"config key 'eval.fraction': must be between 0 and 1, got {cfg.eval.fraction}")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"config key 'optim.lr': must be > 0, got {cfg.optim.lr}")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"config key 'optim.betas': expected 2 numbers, got {cfg.optim.betas}")
    ac = cfg.model.activation_checkpointing
    if ac not in ("none", "all") and not (ac.startswith("every:") and ac[6:].isdigit() and int(ac[6:]) > 0):
        raise ConfigError(f"config key 'model.activation_checkpointing': expected none, all or every:N, got {ac!r}")
    for pattern, style in cfg.mesh.rules.items():
        if style not in ("colwise", "rowwise", "replicate"):
            raise ConfigError(f"config key 'mesh.rules.{pattern}': expected colwise, rowwise or replicate, got {style!r}")


def _read_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"config file {path!r}: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from e


def load_config(path: str | None = None, overrides=()) -> TrainConfig:
    cfg = TrainConfig()
    if path:
        _merge(cfg, _read_yaml(path))
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# What a resumed run must share with the run that saved the checkpoint: the model, the numbers that shape its
# updates and the data it sees. Free to change: steps (to train on), stop_after, the mesh (a checkpoint reshards
# onto another one), compile, activation checkpointing, logging, checkpoint and launch settings.
RESUME_MUST_MATCH = ("seed", "precision", "model.name", "model.config", "data.source", "data.text_field",
                     "data.tokenizer", "data.seq_len", "data.global_batch", "data.grad_accum", "data.num_samples",
                     "optim.", "eval.fraction")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "config":  # model.config compares as one value
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _resume_identity(config: dict) -> dict:
    flat = _flat(config)
    if not flat.get("eval.every"):
        flat["eval.fraction"] = "none (eval.every: 0)"  # no held-out split: every row trains
    return {k: v for k, v in flat.items() if k.startswith(RESUME_MUST_MATCH)}


def resume_differences(saved: dict, cfg: TrainConfig) -> list[str]:
    """'key: saved -> now' for each key in RESUME_MUST_MATCH where cfg differs from the saved config (a to_dict
    through JSON; keys it lacks, from an older trainer, count as their defaults)."""
    import json
    old = _resume_identity(_deep_update(json.loads(json.dumps(to_dict(TrainConfig()))), saved))
    new = _resume_identity(json.loads(json.dumps(to_dict(cfg))))
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]


def _deep_update(base: dict, other: dict) -> dict:
    for k, v in other.items():
        base[k] = _deep_update(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) and k != "config" \
            else v
    return base


def reference_markdown() -> str:
    """The key table of docs/train.md, made from the dataclasses."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(obj, prefix):
        for name, (f, tp) in _fields(obj).items():
            value = getattr(obj, name)
            if dataclasses.is_dataclass(tp):
                walk(value, prefix + name + ".")
            else:
                rows.append(f"| `{prefix}{name}` | {tp.__name__} | `{value!r}` | {f.metadata.get('doc', '')} |")
    walk(TrainConfig(), "")
    return "\n".join(rows) + "\n"
