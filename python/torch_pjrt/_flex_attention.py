"""flex_attention on tpu."""
from __future__ import annotations

import functools

from ._compile_backend import BACKEND

# torch's flex_attention refuses devices outside its list (CUDA, CPU, XPU, HPU,
# MPS) before anything runs. On tpu, eager calls run the higher-order op's dense
# implementation (scores materialized, score_mod and mask_mod applied to them,
# softmax, @v; its backward likewise) through the eager lowerings, and compiled
# calls keep the op in the graph this backend runs as one program, so the
# numbers are the CPU's dense ones in both. Block sparsity only skips work
# there: the mask_mod decides which scores count.


def allow_flex_attention() -> None:
    import torch.nn.attention.flex_attention as flex

    validate = flex._validate_device
    if getattr(validate, "_torch_pjrt_allowed", False):
        return

    @functools.wraps(validate)
    def _validate_device(query, key, value):
        if query.device.type == BACKEND:
            return None  # every device check after this one is about CUDA's kernels
        return validate(query, key, value)

    _validate_device._torch_pjrt_allowed = True
    flex._validate_device = _validate_device
