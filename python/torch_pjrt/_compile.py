"""torch.compile on tpu: the names other modules, tests and the entry point use, from the modules that do the work.

  _compile_backend    the Dynamo backend 'tpu' (tpu_backend): each AOTAutograd graph as one XLA program in one
                      scope (_OneProgram: the calling thread in fused mode, no size cuts, one cut at its end), and
                      its replay
  _inference_buckets  which inference graphs keep their batch rows apart, and their power-of-two batch buckets
  _training_buckets   training graphs at batch buckets: the loss's reductions over the batch masked to real rows
  _source_lines       errors inside a compiled graph name the user's line
  _compile_routing    registration, and tpu graphs that reach Inductor (plain torch.compile) sent to the backend
  _flex_attention     torch's flex_attention accepts tpu tensors

pyproject's torch_dynamo_backends entry point names torch_pjrt._compile:tpu_backend.
"""
from __future__ import annotations

from ._compile_backend import BACKEND, decompositions, run_as_one_graph, tpu_backend, user_mode  # noqa: F401
from ._compile_routing import register, route_inductor, _routed_graphs  # noqa: F401
from ._flex_attention import allow_flex_attention  # noqa: F401
from ._inference_buckets import _bucket_calls, bucket_refusal  # noqa: F401
from ._source_lines import source_line  # noqa: F401
