"""vLLM's CPU worker and CPU model runner, with the model and its KV cache on tpu.

The runner (TpuModelRunner, a CPUModelRunner) keeps every buffer of the scheduler's bookkeeping on the
host, as on vLLM's CPU platform: token ids, positions, query starts, sequence lengths, block tables, slot
mappings (computed by kernels.compute_slot_mapping) and the sampler's state. What runs on tpu:

- the model, built on tpu by vLLM's loader (the device config's device is `tpu`); a forward pre-hook sends
  it the step's input ids and positions;
- the attention metadata, sent once a step by the backend's builder (attention.py);
- one KV cache tensor per layer, allocated here in the backend's page layout;
- compute_logits, whose logits come back to the host for the sampler.

Each step runs at a padded shape (buckets.py): its token count rounds up to a token bucket (vLLM pads the
input ids and positions to the batch descriptor's token count) and its request count to a request bucket (the
logit rows here, the attention metadata in the backend's builder). The worker's compile_or_warm_up_model, which
vLLM calls once the KV cache is allocated, runs a dummy step of every pair, then the sampler once (vLLM's
torch.compile'd logprob ranks), so serving compiles nothing.

Seeded requests sample with host generators; the runner rewinds those of partial-prefill steps by their state
(_sample, _bookkeeping_sync), where vLLM moves a CUDA generator's offset, which CPU generators lack.

The worker (TpuWorker, a CPUWorker) initialises the device and torch.distributed (the `tpu_dist` backend)
instead of the CPU's memory-node binding and OpenMP set-up, and sizes the KV cache from the device's memory.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

import torch_pjrt

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheConfig, UniformTypeKVCacheSpecs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import bind_kv_cache

from .attention import TpuAttentionBackend
from .attention_kernels import apply_vllm_setting
from .buckets import Buckets

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger, which has the handlers

# The most KV cache taken on the CPU PJRT plugin when kv_cache_memory_bytes is not given: its device
# memory is the host's, shared with everything else, and on it a step's in-place page writes cost time in
# proportion to the whole cache (docs/serving.md, "Not yet").
HOST_DEVICE_KV_CACHE_CAP = 256 << 20


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value


class TpuModelRunner(CPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, model_device: torch.device):
        # CPUModelRunner's buffers, metadata and sampler stay on the host (`device`).
        self.model_device = model_device
        super().__init__(vllm_config, device)
        # Each step's token count and request count round up to a bucket (buckets.py): the model runs on the
        # padded tokens, the attention builder pads its metadata the same way, and the logits of the padded
        # request rows are dropped on the host.
        self.buckets = Buckets.from_config(vllm_config)
        self._logit_rows: int | None = None  # the real rows of the next compute_logits, when padded
        self.bucket_warm_up_stats: dict[str, Any] = {}  # warm_up_buckets' buckets, time, compiles
        self._rewound_generators: set[int] = set()  # _sample's, for _bookkeeping_sync
        self.model_steps = 0  # forwards of the model (steps, the warm-up's included): per-step metrics divide by it

    def _sample(self, logits, spec_decode_metadata):
        # A seeded request's generator is a host generator (the sampler runs on the host). A request whose step
        # is a partial prefill samples a token that is discarded, and vLLM then rewinds its generator by moving
        # its Philox offset back (_bookkeeping_sync), which a CPU generator does not have ("CPU Generator does
        # not use offset"). Here such generators get the state they had before sampling back instead, so that a
        # seeded request's tokens do not depend on how its prompt was chunked, and _bookkeeping_sync skips them.
        generators = self.input_batch.generators
        discarded = np.nonzero(self.discard_request_mask.np[:self.input_batch.num_reqs])[0].tolist()
        states = {i: generators[i].get_state() for i in discarded if i in generators}
        output = super()._sample(logits, spec_decode_metadata)
        for i, state in states.items():
            generators[i].set_state(state)
        self._rewound_generators = set(states)
        return output

    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        rewound = {i: generators.pop(i) for i in self._rewound_generators if i in generators}
        self._rewound_generators = set()
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(rewound)

    def _determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int, *args, **kwargs):
        # vLLM pads the model's inputs (input ids, positions) to the batch descriptor's token count: the
        # step's token bucket. The attention metadata stays unpadded here (no full CUDA graph), and
        # TpuAttentionMetadataBuilder pads it to the same buckets.
        mode, descriptor, *rest = super()._determine_batch_execution_and_padding(num_tokens, num_reqs, *args,
                                                                                **kwargs)
        descriptor = dataclasses.replace(descriptor, num_tokens=self.buckets.num_tokens(descriptor.num_tokens))
        return (mode, descriptor, *rest)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self._logit_rows = None
        logits_indices, spec_decode_metadata, max_num_sampled_tokens = super()._prepare_inputs(
            scheduler_output, num_scheduled_tokens)
        if spec_decode_metadata is None:
            # One logit row per request, padded to the request bucket with rows of token 0; compute_logits
            # (load_model's wrapper) hands the sampler the real rows only.
            rows = logits_indices.shape[0]
            padded = logits_indices.new_zeros(self.buckets.num_reqs(rows))
            padded[:rows] = logits_indices
            logits_indices, self._logit_rows = padded, rows
        return logits_indices, spec_decode_metadata, max_num_sampled_tokens

    def _model_forward(self, *args, **kwargs):
        self.model_steps += 1
        return super()._model_forward(*args, **kwargs)

    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights)  # vLLM's loader builds the model on the device config's tpu
        self._send_inputs_to_device(self.model)

    def _send_inputs_to_device(self, model: torch.nn.Module) -> None:
        device = self.model_device

        def send_inputs(module, args, kwargs):
            return (tuple(_to_device(a, device) for a in args),
                    {k: _to_device(v, device) for k, v in kwargs.items()})

        model.register_forward_pre_hook(send_inputs, with_kwargs=True)
        # The runner picks the hidden states of the tokens to sample (a host index into a tpu tensor
        # gives a tpu tensor) and hands them to compute_logits; the sampler reads the logits on the host.
        compute_logits = model.compute_logits

        def logits_on_host(hidden_states: torch.Tensor, *args, **kwargs):
            rows, self._logit_rows = self._logit_rows, None
            logits = compute_logits(hidden_states.to(device), *args, **kwargs)
            if logits is None:
                return None
            logits = logits.to(self.device)  # all the bucket's rows: slicing on tpu would be a new program
            return logits if rows is None else logits[:rows]

        model.compute_logits = logits_on_host

    def attention_bytes(self, num_tokens: int, num_reqs: int) -> int:
        """The largest intermediate of a step's attention (packed_attention.cpp): float32 scores of every query
        head and token against every key slot of every request's block-table row."""
        table = self.input_batch.block_table[0]
        keys = num_reqs * table.max_num_blocks_per_req * table.block_size
        heads = self.model_config.get_num_attention_heads(self.parallel_config)
        return 4 * heads * num_tokens * keys

    @torch.inference_mode()  # as execute_model: the same graphs (torch_pjrt cuts one where a module call returns)
    def warm_up_buckets(self) -> None:
        """Runs a step of every (token bucket, request bucket) pair once, so that each program a step can
        need is compiled (or loaded from torch_pjrt's disk cache) before serving. Every request of these steps
        is padding: their attention sees no key and their keys and values go to the null block.

        Pairs whose attention would take more than a quarter of the device's free memory are left out (and
        logged): such a step could not run anyway, and vLLM's default limits (8192 tokens, 256 requests) give
        pairs of many GiB with a long max_model_len."""
        if not self.kv_caches:
            return
        # Run what is pending (the caches' zeros, the weights' copies) first: recorded into the first bucket's
        # graph, it would make that graph one no step finds again.
        torch_pjrt.sync()
        budget = torch.tpu.mem_get_info(self.model_device)[0] // 4
        pairs, skipped = [], []
        for pair in self.buckets.pairs():
            (pairs if self.attention_bytes(*pair) <= budget else skipped).append(pair)
        if skipped:
            logger.warning("Not warming up %d (tokens, requests) buckets whose attention would need more than %s "
                           "GiB (a quarter of the free device memory): %s. A step of those shapes compiles when it "
                           "first comes; lower max_num_batched_tokens, max_num_seqs or max_model_len to avoid them.",
                           len(skipped), format_gib(budget), skipped)
        logger.info("Warming up %d (tokens, requests) buckets: tokens %s, requests %s", len(pairs),
                    list(self.buckets.tokens), list(self.buckets.requests))
        start = time.perf_counter()
        before = torch_pjrt.metrics()
        logits = None
        for num_tokens, num_reqs in pairs:
            logits = self._dummy_bucket_step(num_tokens, num_reqs)
        if logits is not None:
            self._warm_up_sampler(logits)
        torch_pjrt.sync()
        after = torch_pjrt.metrics()
        self.bucket_warm_up_stats = {
            "tokens": list(self.buckets.tokens), "requests": list(self.buckets.requests),
            "pairs": len(pairs), "skipped": skipped, "seconds": time.perf_counter() - start,
            "compiles": after["compiles"] - before["compiles"],
            "disk_cache_hits": after["disk_cache_hits"] - before["disk_cache_hits"]}
        logger.info("Warmed up %d buckets in %.1f s: %d compiles, %d programs from the disk cache", len(pairs),
                    self.bucket_warm_up_stats["seconds"], self.bucket_warm_up_stats["compiles"],
                    self.bucket_warm_up_stats["disk_cache_hits"])

    def _dummy_bucket_step(self, num_tokens: int, num_reqs: int) -> None:
        """execute_model's device work for a step of num_tokens tokens and num_reqs requests, all padding."""
        attn_metadata: dict[str, Any] = {}
        for gid, groups in enumerate(self.attn_groups):
            block_table = self.input_batch.block_table[gid].get_device_tensor(0)
            for group in groups:
                empty = group.map_to_kernel_block_table(block_table, 0)
                metadata = group.get_metadata_builder(0).padded(
                    num_tokens, num_reqs, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                    empty, torch.zeros(0, dtype=torch.int64), 0, 0)
                for name in group.layer_names:
                    attn_metadata[name] = metadata
        input_ids = torch.zeros(num_tokens, dtype=self.input_ids.cpu.dtype)
        positions = torch.zeros(num_tokens, dtype=self.positions.dtype)
        logits_indices = torch.zeros(num_reqs, dtype=self.query_start_loc.cpu.dtype)
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=num_tokens, slot_mapping={}):
            hidden_states = self._model_forward(input_ids=input_ids, positions=positions, intermediate_tensors=None,
                                                inputs_embeds=None, **self._init_model_kwargs())
        return self.model.compute_logits(hidden_states[logits_indices])

    def _warm_up_sampler(self, logits: torch.Tensor) -> None:
        """Runs the sampler once (on the host, as every step does) over a dummy step's logits with what a request
        can ask for: temperature, top-k, top-p, a seed and logprobs. The sampler's logprob ranks
        (vllm.v1.sample.ops.logprobs.batched_count_greater_than) are a torch.compile'd function (the platform's
        simple_compile_backend) that Dynamo would otherwise trace on the first request asking for logprobs (about a
        second); its batch dimension is unbacked, so one trace serves every batch size. The rest of the sampler is
        eager torch on the host and compiles nothing."""
        rows = logits.shape[0]

        def full(value, dtype=torch.float32):
            return torch.full((rows,), value, dtype=dtype, device=self.device)

        metadata = SamplingMetadata(
            temperature=full(0.5), all_greedy=False, all_random=True, top_p=full(0.9),
            top_k=full(2, torch.int32), generators={0: torch.Generator(device=self.device).manual_seed(0)},
            max_num_logprobs=1, no_penalties=True, prompt_token_ids=None, frequency_penalties=full(0.0),
            presence_penalties=full(0.0), repetition_penalties=full(1.0), output_token_ids=[[] for _ in range(rows)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
            spec_token_ids=[[] for _ in range(rows)])
        self.sampler(logits=logits.to(self.device, dtype=torch.float32), sampling_metadata=metadata)

    def initialize_kv_cache_tensors(self, kv_cache_config: KVCacheConfig, kernel_block_sizes: list[int],
                                    kv_cache_allocation_context: AbstractContextManager | None = None,
                                    ) -> dict[str, torch.Tensor]:
        """One tpu tensor per layer in TpuAttentionBackend's layout, instead of vLLM's views of one int8
        buffer: the layers' pools are separate programs' operands, updated in place."""
        specs: dict[str, AttentionSpec] = {}
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                spec = group.kv_cache_spec
                if isinstance(spec, UniformTypeKVCacheSpecs):
                    spec = spec.kv_cache_specs[name]
                if not isinstance(spec, AttentionSpec):
                    raise NotImplementedError(f"{type(spec).__name__} KV caches on torch_pjrt's vLLM platform")
                specs[name] = spec
        kv_caches: dict[str, torch.Tensor] = {}
        with kv_cache_allocation_context or nullcontext():
            for tensor in kv_cache_config.kv_cache_tensors:
                num_blocks = kv_cache_config.num_blocks_of(tensor)
                for name in tensor.layers:
                    spec = specs[name]
                    shape = TpuAttentionBackend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads,
                                                               spec.head_size)
                    kv_caches[name] = torch.zeros(shape, dtype=spec.dtype, device=self.model_device)
        for name, target in self.shared_kv_cache_layers.items():
            kv_caches[name] = kv_caches[target]
        bind_kv_cache(kv_caches, self.compilation_config.static_forward_context, self.kv_caches,
                      kv_cache_groups=kv_cache_config.kv_cache_groups)
        return kv_caches

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        # Pages handed out again start from zeros (vLLM asks for it where a partial write could leave
        # stale rows): both pools of each full-attention layer, in one write per layer.
        if not block_ids:
            return
        seen: set[int] = set()
        for group in self.kv_cache_config.kv_cache_groups:
            if not isinstance(group.kv_cache_spec, FullAttentionSpec):
                continue
            for name in group.layer_names:
                layer = self.compilation_config.static_forward_context.get(name)
                cache = getattr(layer, "kv_cache", None)
                if not isinstance(cache, torch.Tensor) or id(cache) in seen:
                    continue
                seen.add(id(cache))
                cache[:, torch.tensor(block_ids, device=cache.device)] = 0


class TpuWorker(CPUWorker):
    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False):
        # CPUWorker.__init__ binds the process to a NUMA memory node through vllm._C and checks host
        # memory: skipped for vLLM's Worker's own set-up.
        Worker.__init__(self, vllm_config, local_rank, rank, distributed_init_method,
                        is_driver_worker=is_driver_worker)
        self.parallel_config.disable_custom_all_reduce = True

    def init_device(self):
        if torch_pjrt.unavailable_reason is not None:
            raise RuntimeError(f"the tpu device is unavailable: {torch_pjrt.unavailable_reason}")
        self.device = torch.device("tpu", self._device_index())
        torch.tpu.set_device(self.device)
        # A program whose runtime check fails (a slot out of range) still raises its error, but does not keep
        # the values it would have written: keeping them selects every written storage whole against its old
        # value, which made each step's in-place page write cost the whole KV cache (64 MiB: 34 ms a step, 0.06
        # ms without). A failed step fails its requests; the cache pages are theirs.
        torch_pjrt._C._set_keep_values_on_failed_checks(False)
        # A platform attention kernel named in additional_config (attention_kernels.py), registered in this
        # process before the model runs; none: the portable lowering.
        kernel = apply_vllm_setting(self.vllm_config.additional_config)
        if kernel is not None:
            logger.info("attention: the platform kernel %s on %s", getattr(kernel, "__name__", kernel),
                        torch_pjrt.platform()["name"])
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        self.model_runner = TpuModelRunner(self.vllm_config, torch.device("cpu"), self.device)

    def _device_index(self) -> int:
        """This worker's device: tpu:<local_rank> where the process sees a device per local rank (a host's chips).
        On the CPU PJRT plugin each worker process starts a client of its own, whose devices are its own host
        memory (TORCH_PJRT_CPU_DEVICES of them, 1 by default): there local_rank % count, as torch_pjrt.distributed
        binds a torchrun process, so tensor_parallel_size=2 runs with one device per process."""
        count = torch.tpu.device_count()
        if self.local_rank < count:
            return self.local_rank
        if count > 0 and torch_pjrt.platform()["name"] == "cpu":
            return self.local_rank % count
        raise RuntimeError(f"vLLM worker {self.local_rank} has no tpu device: this process sees {count}")

    def compile_or_warm_up_model(self):
        # Called once the KV cache is allocated: every program a step can need compiles here, not while serving.
        self.model_runner.warm_up_buckets()
        return super().compile_or_warm_up_model()

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        return nullcontext()  # no CuMem pool: torch_pjrt allocates through PJRT

    def determine_available_memory(self) -> int:
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit is not None:
            logger.info("KV cache: %s GiB as asked (kv_cache_memory_bytes)", format_gib(explicit))
            return explicit
        torch_pjrt.sync()
        free, total = torch.tpu.mem_get_info(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization) - (total - free)
        if torch_pjrt.platform()["name"] == "cpu":
            # The CPU plugin's memory is the host's, shared with this process and every other one.
            budget = min(budget, HOST_DEVICE_KV_CACHE_CAP)
        if budget <= 0:
            raise ValueError(f"no tpu memory left for the KV cache ({format_gib(free)} of {format_gib(total)} GiB "
                             f"free, gpu_memory_utilization {self.cache_config.gpu_memory_utilization}): lower "
                             "the model's footprint or pass kv_cache_memory_bytes")
        logger.info("KV cache: %s GiB of tpu memory (%s of %s GiB free)", format_gib(budget), format_gib(free),
                    format_gib(total))
        return budget

    def torch_pjrt_metrics(self) -> dict:
        """torch_pjrt.metrics() of this worker's process (compiles, CPU fallbacks per op, ...), `model_steps`, the
        model's forwards since the last reset (per-step costs divide by it), and `dynamo_graphs`, the graphs
        Dynamo has traced in this process (vLLM's torch.compile'd helpers; not reset): read from the front end
        with LLM.collective_rpc("torch_pjrt_metrics")."""
        from torch._dynamo.utils import counters

        torch_pjrt.sync()
        return dict(torch_pjrt.metrics(), model_steps=self.model_runner.model_steps,
                    dynamo_graphs=counters["stats"]["unique_graphs"])

    def torch_pjrt_warm_up(self) -> dict:
        """What the bucket warm-up at engine start did (LLM.collective_rpc("torch_pjrt_warm_up")): the token and
        request buckets, the pairs run, seconds, compiles and programs loaded from the disk cache."""
        return dict(self.model_runner.bucket_warm_up_stats)

    def torch_pjrt_reset_metrics(self) -> None:
        torch_pjrt.sync()
        torch_pjrt.reset_metrics()
        self.model_runner.model_steps = 0

    def torch_pjrt_memory(self, reset_peak: bool = False) -> dict:
        """This worker's device memory (LLM.collective_rpc("torch_pjrt_memory")): bytes of its KV cache tensors
        (`kv_cache_bytes`, `kv_cache_tensors`; the largest in `kv_cache_largest_bytes`), bytes allocated now and
        the peak since the last reset (torch.tpu's statistics: the storages of tpu tensors, where a pending graph's
        intermediates count until it runs, not an XLA program's own temporaries). reset_peak=True starts a new peak
        from the bytes allocated now."""
        torch_pjrt.sync()
        caches = {id(t): t for t in self.model_runner.kv_caches if isinstance(t, torch.Tensor)}
        sizes = [t.numel() * t.element_size() for t in caches.values()]
        if reset_peak:
            torch.tpu.reset_peak_memory_stats(self.device)
        return {"kv_cache_bytes": sum(sizes), "kv_cache_tensors": len(sizes),
                "kv_cache_largest_bytes": max(sizes, default=0),
                "allocated": torch.tpu.memory_allocated(self.device),
                "peak": torch.tpu.max_memory_allocated(self.device)}
