"""Stand-ins, in torch ops, for the vLLM kernels the tpu platform's runner calls without Triton.

vLLM's CPU platform replaces them with C++ ops from vllm._C; ours are plain torch, so they run on whatever
device their tensors are on (the runner's host buffers today).
"""
from __future__ import annotations

import torch


def compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc_ptr, positions_ptr, block_table_ptr,
                         block_table_stride, slot_mapping_ptr, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE=1,
                         TOTAL_CP_RANK=0, CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024):  # noqa: N803
    """vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel's work (the parameter names are the
    kernel's, so vLLM's dispatcher passes them by name): the cache slot of each scheduled token, the
    slot of its position in its request's block table row, and PAD_ID for the rest of the buffer."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("context parallelism on torch_pjrt's vLLM platform")
    block = KV_CACHE_BLOCK_SIZE
    starts = query_start_loc_ptr.to(torch.int64)
    tokens = torch.arange(num_tokens, device=starts.device)
    # Token t belongs to request r when starts[r] <= t < starts[r + 1].
    request = torch.searchsorted(starts[1:], tokens, right=True)
    positions = positions_ptr[:num_tokens].to(torch.int64)
    table = block_table_ptr.reshape(-1)
    pages = table[request * block_table_stride + torch.div(positions, block, rounding_mode="floor")]
    slot_mapping_ptr[:num_tokens] = pages.to(torch.int64) * block + torch.remainder(positions, block)
    slot_mapping_ptr[num_tokens:max_num_tokens] = PAD_ID
