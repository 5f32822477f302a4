"""Paged attention on tpu for vLLM: the KV cache write and attention in torch ops that torch_pjrt lowers.

The cache of a layer is one tpu tensor [2, num_blocks, block_size, num_kv_heads, head_size]: keys at [0],
values at [1], each a pool of pages in the layout torch.nn.attention.varlen.varlen_attn reads through a
block table (csrc/aten/lowerings/packed_attention.cpp). A step writes its new keys and values in place by
slot (slot = page * block_size + row, vLLM's slot mapping) with one index_copy_ on a [slots, heads, dim] view
of the layer's whole cache (values' slots one pool further), then attends with varlen_attn over the pools: cu_seq_q from the query starts, seqused_k from the
sequence lengths, the block table as the scheduler filled it, causal aligned bottom-right (a request's new
queries are its last tokens). No vllm._C op is called. A platform can replace varlen_attn's portable lowering
with a JAX kernel of its own (attention_kernels.py, vLLM's additional_config "torch_pjrt_attention_kernel").

The builder pads the metadata to the step's buckets (buckets.py): padded tokens follow the last request's and
write into vLLM's null block (block 0, never handed to a request); padded requests have no queries, sequence
length 0 and a block-table row of the null block. The tokens of no request, and requests with no keys, get
zeros from varlen_attn's lowering.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.nn.attention.varlen import varlen_attn

from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.kv_cache_interface import AttentionSpec

from .buckets import Buckets


class TpuAttentionBackend(AttentionBackend):
    # forward() writes the cache itself: it has the step's metadata (the slots on tpu) at hand.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        # The name the Attention layer looks up in AttentionBackendEnum; platform.py registers this class
        # as CUSTOM's.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TpuAttentionImpl]:
        return TpuAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TpuAttentionMetadataBuilder]:
        return TpuAttentionMetadataBuilder

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """The shape the runner (worker.py) allocates each layer's cache with."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


@dataclass
class TpuAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on tpu
    seq_lens: torch.Tensor  # int32 [num_reqs], on tpu: keys of each request, this step's included
    block_table: torch.Tensor  # int32 [num_reqs, pages per request], on tpu
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], on tpu
    causal: bool = True


class TpuAttentionMetadataBuilder(AttentionMetadataBuilder[TpuAttentionMetadata]):
    """Pads the step's host metadata to its buckets (buckets.py) and sends it to tpu once; every layer's
    forward reads the same tensors."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # The runner builds on the host (device is the CPU); the model and its cache are on tpu.
        self.model_device = vllm_config.device_config.device
        self.buckets = Buckets.from_config(vllm_config)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TpuAttentionMetadata:
        m = common_attn_metadata
        if not isinstance(m.causal, bool):
            raise NotImplementedError("per-token causal masks on torch_pjrt's vLLM attention backend")
        n, r = m.num_actual_tokens, m.num_reqs
        return self.padded(self.buckets.num_tokens(n), self.buckets.num_reqs(r), m.query_start_loc_cpu[: r + 1],
                           m.seq_lens[:r], m.block_table_tensor[:r], m.slot_mapping[:n], m.max_query_len,
                           m.max_seq_len, m.causal)

    def padded(self, num_tokens: int, num_reqs: int, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, slot_mapping: torch.Tensor, max_query_len: int, max_seq_len: int,
               causal: bool = True) -> TpuAttentionMetadata:
        """The metadata of a step padded to num_tokens and num_reqs, from host tensors of its real tokens and
        requests (TpuModelRunner.warm_up_buckets passes none of either). Padded requests start after the last
        token, hold no keys and read the null block; padded tokens write into the null block, which no request
        reads (a block table row's unused entries are masked by its sequence length)."""
        n, r = slot_mapping.shape[0], seq_lens.shape[0]
        starts = torch.full((num_reqs + 1,), int(query_start_loc[r]) if r else 0, dtype=torch.int32)
        starts[: r + 1] = query_start_loc
        lengths = torch.zeros(num_reqs, dtype=torch.int32)
        lengths[:r] = seq_lens
        table = torch.full((num_reqs, block_table.shape[1]), NULL_BLOCK_ID, dtype=torch.int32)
        table[:r] = block_table
        # The null block's rows, in turn (fewer duplicate slots in one write).
        slots = torch.arange(num_tokens, dtype=torch.int64).remainder_(self.block_size).add_(
            NULL_BLOCK_ID * self.block_size)
        slots[:n] = slot_mapping
        to = self.model_device
        return TpuAttentionMetadata(
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=starts.to(to),
            seq_lens=lengths.to(to),
            block_table=table.to(to),
            slot_mapping=slots.to(to),
            causal=causal,
        )


class TpuAttentionImpl(AttentionImpl[TpuAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes: list[float] | None = None, sliding_window: int | None = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("ALiBi on torch_pjrt's vLLM attention backend")
        if logits_soft_cap:
            raise NotImplementedError("logit soft-capping on torch_pjrt's vLLM attention backend")
        if sinks is not None:
            raise NotImplementedError("attention sinks on torch_pjrt's vLLM attention backend")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{attn_type} attention on torch_pjrt's vLLM attention backend")
        if kv_cache_dtype not in ("auto", "float16", "bfloat16", "float32"):
            raise NotImplementedError(f"a {kv_cache_dtype} KV cache on torch_pjrt's vLLM attention backend")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # vLLM's window counts the query's own token: W keys back means W - 1 before it.
        self.window = (-1, 0) if not sliding_window else (sliding_window - 1, 0)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: TpuAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization on torch_pjrt's vLLM attention backend")
        if attn_metadata is None:  # a profiling run without a cache
            return output
        n = attn_metadata.num_actual_tokens  # the step's token bucket: the rows of query, key and value
        if query.shape[0] != n:
            raise RuntimeError(f"a step of {query.shape[0]} tokens with attention metadata padded to {n}: "
                               "the runner and the metadata builder disagree on the token bucket")
        keys, values = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_size] each
        if self.kv_sharing_target_layer_name is None and key is not None:
            # One write over the layer's whole storage (keys' slots, then values' one pool further): a write
            # into a view of part of a storage becomes slice, update and a copy of that part back, which cost
            # time in proportion to the cache (64 MiB: 22 ms a step, 0.4 ms this way).
            slots = attn_metadata.slot_mapping
            pool = keys.shape[0] * keys.shape[1]
            kv_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(
                0, torch.cat([slots, slots + pool]), torch.cat([key[:n], value[:n]]).to(kv_cache.dtype))
        # max_q and max_k do not shape torch_pjrt's program (the lengths are runtime operands): pass bounds
        # that do not change from step to step, so they never key a new program.
        out = varlen_attn(
            query[:n], keys, values, attn_metadata.query_start_loc, None,
            query.shape[0], keys.shape[0] * keys.shape[1],
            scale=self.scale, window_size=self.window if attn_metadata.causal else (-1, -1),
            enable_gqa=self.num_heads != self.num_kv_heads,
            seqused_k=attn_metadata.seq_lens, block_table=attn_metadata.block_table)
        output[:n] = out.to(output.dtype)
        return output
