"""torch_pjrt.train: a small config-driven trainer on the `tpu` device (docs/train.md).

    python -m torch_pjrt.train CONFIG.yaml [key=value ...]
"""
from .config import ConfigError, TrainConfig, load_config
from .trainer import PRESETS, Trainer, make_model

__all__ = ["ConfigError", "TrainConfig", "load_config", "Trainer", "PRESETS", "make_model"]
