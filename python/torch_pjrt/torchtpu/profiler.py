"""torch.tpu.profiler: TorchTPU's profiler configuration, accepted by torch.profiler.profile.

torch_pjrt's compiles and program runs are torch.profiler events (torch_pjrt::compile(...),
torch_pjrt::execute(...)) on the CPU activity, whatever the configuration; the tracer levels, run_dir and
worker_rank configure TorchTPU's XProf tracer, which torch_pjrt does not have. They are checked as TorchTPU
checks them and kept as attributes.
"""
from __future__ import annotations

import os

import torch.profiler

__all__ = ["TpuProfilerConfig"]

_STABLE_KEYS = ("host_tracer_level", "device_tracer_level", "python_tracer_level", "run_dir", "worker_rank",
                "check_experimental_options")


class TpuProfilerConfig(torch.profiler._ExperimentalConfig):
    """torch.profiler.profile(experimental_config=TpuProfilerConfig(...)) with TorchTPU's options."""

    def __init__(self, *, host_tracer_level: int = 2, device_tracer_level: int = 1, python_tracer_level: int = 0,
                 run_dir=None, worker_rank=None, experimental_options=None, check_experimental_options: bool = True):
        if worker_rank is not None:
            if not isinstance(worker_rank, str):
                raise TypeError(f"worker_rank must be a string, got {type(worker_rank)}")
            if ":" in worker_rank or "," in worker_rank:
                raise ValueError(f"worker_rank string cannot contain ':' or ',': {worker_rank!r}")
        for key, value in (experimental_options or {}).items():
            if key in _STABLE_KEYS:
                raise ValueError(f"Experimental option key cannot clash with stable option: {key!r}")
            if ":" in key or "," in key:
                raise ValueError(f"Experimental option keys cannot contain ':' or ',': {key!r}")
            if not isinstance(value, (int, bool, str)):
                raise TypeError(f"experimental option {key!r} must be an int, bool or str, got {type(value)}")
        super().__init__()
        self.host_tracer_level = host_tracer_level
        self.device_tracer_level = device_tracer_level
        self.python_tracer_level = python_tracer_level
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        self.worker_rank = worker_rank
        self.experimental_options = dict(experimental_options or {})
        self.check_experimental_options = check_experimental_options
