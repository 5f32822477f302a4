"""The vLLM platform for the `tpu` device (docs/serving.md).

vLLM sees an out-of-tree platform (PlatformEnum.OOT) whose device type is `tpu` and whose custom ops
register under the PrivateUse1 dispatch key. Its worker and model runner (worker.py) are vLLM's CPU worker
and CPU model runner with the model and the KV cache moved to `tpu`: the scheduler's bookkeeping (input
ids, positions, block tables, slot mappings, sampling) stays on the host, as on vLLM's CPU platform, and
each step sends the model its inputs and brings back the logits of the tokens to sample.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

import torch_pjrt  # noqa: F401 - registers the tpu device, its compile backend and the tpu_dist c10d backend

from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, which has the handlers

ATTENTION_BACKEND = "torch_pjrt.vllm.attention.TpuAttentionBackend"
WORKER = "torch_pjrt.vllm.worker.TpuWorker"

# The Attention layer looks its backend up by name in AttentionBackendEnum: ours answers CUSTOM.
# Registered at import, in every process that resolves the platform (vLLM spawns its engine core).
register_backend(AttentionBackendEnum.CUSTOM, ATTENTION_BACKEND)


def _dist_backend() -> str:
    from torch_pjrt import distributed

    return distributed.BACKEND_NAME if torch.distributed.is_available() else "gloo"


class TpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    dist_backend: str = _dist_backend()
    # torch.compile(backend="tpu"): torch_pjrt's dynamo backend, for the small functions vLLM compiles
    # on their own (logprob ranks, masked embedding inputs). It runs CPU tensors too.
    simple_compile_backend: str = "tpu"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.tpu.mem_get_info(device_id)[1]

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        free, total = torch.tpu.mem_get_info(device)
        return float(total - free)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"torch_pjrt's vLLM platform runs bfloat16, float16 and float32 models, not {dtype}")

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's compiled kernels (vllm._C) are CPU or CUDA code: none of them runs on tpu tensors. Not
        # importing them makes any torch.ops._C call on this platform fail loudly instead of running on
        # the host.
        return

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # Without Triton, the runner's slot mapping kernel needs a stand-in (vLLM's CPU platform uses a
        # C++ op from vllm._C): ours is written with torch ops on the host buffers.
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:
            return
        from vllm.triton_utils.dispatcher import register_kernels

        from .kernels import compute_slot_mapping

        register_kernels({"vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping})

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        if attn_selector_config.use_mla:
            raise NotImplementedError("torch_pjrt's vLLM platform has no MLA attention backend yet")
        if attn_selector_config.use_sparse:
            raise NotImplementedError("torch_pjrt's vLLM platform has no sparse attention backend")
        if selected_backend is not None and selected_backend != AttentionBackendEnum.CUSTOM:
            logger.info("Attention backend %s is not available on tpu: using torch_pjrt's", selected_backend)
        return ATTENTION_BACKEND

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        model_config = vllm_config.model_config
        if model_config is not None and getattr(model_config, "use_mla", False):
            raise NotImplementedError("torch_pjrt's vLLM platform has no MLA attention backend yet")

        compilation_config = vllm_config.compilation_config
        # Step 1 of issue 32 runs the model eagerly on tpu (torch_pjrt's own execution mode fuses the
        # ops of a step into one program); vLLM's graph modes (piecewise dynamo + inductor, CUDA graphs)
        # are for later.
        if compilation_config.mode != CompilationMode.NONE:
            logger.info("torch_pjrt's vLLM platform runs the model eagerly (compilation mode NONE)")
        compilation_config.mode = CompilationMode.NONE
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        compilation_config.cudagraph_capture_sizes = []
        compilation_config.max_cudagraph_capture_size = 0

        # The runner keeps host buffers and steps synchronously, as vLLM's CPU runner does.
        vllm_config.scheduler_config.async_scheduling = False

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = WORKER
        if parallel_config.enable_dbo:
            parallel_config.enable_dbo = False
        parallel_config.disable_custom_all_reduce = True

        vllm_config.profiler_config.torch_profiler_dump_cuda_time_total = False
        assert vllm_config.device_config.device_type == "tpu", vllm_config.device_config.device_type

        # Worker processes start by spawn: a forked child would inherit the PJRT client's threads.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Eager execution: the Attention layer calls the backend directly, not through
        # torch.ops.vllm.unified_attention_with_output.
        return False

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # The runner's list of caches is only read by _zero_block_ids (worker.py), which reads the
        # layers' own caches.
        return

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False
