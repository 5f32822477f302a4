"""Platform attention kernels for vLLM (python/torch_pjrt/vllm/attention_kernels.py): a JAX ragged paged attention
registered for this process's plugin takes varlen_attn's paged calls, against the portable lowering
(packed_attention.cpp) and a float64 reference; no engine is started.

Every test registers its kernel through the `kernel` fixture, which takes it away again: varlen_attn goes back to
the portable lowering (the hook on torch_attn::_varlen_attn stays, and does what the op's own implementation does).
"""
import functools
import os
import sys

import pytest
import torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn

import torch_pjrt

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from torch_pjrt.vllm import attention_kernels as ak  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lowerings"))
from test_packed_attention import reference  # noqa: E402

HERE = torch_pjrt.platform()["name"]  # "cpu" on the CPU PJRT plugin
OTHER = "tpu" if HERE != "tpu" else "cuda"


@pytest.fixture
def kernel():
    """register(fn=None, platform=HERE) for the test; every platform's kernel is taken away after it."""
    def register(fn=None, platform=HERE):
        return ak.register_attention_kernel(fn, platform=platform)

    try:
        yield register
    finally:
        for platform in ak.PLATFORMS:
            ak.unregister_attention_kernel(platform)


class Step:
    """A vLLM-like step over paged pools: requests of `q_lens` new tokens with `k_lens` keys each (the new ones
    included), their pages scattered over the pool through the block table, the queries padded to `tokens` and the
    requests to len(q_lens) + `pad_requests` (no queries, no keys, the null block's row), as the backend's
    metadata builder pads them."""

    def __init__(self, q_lens, k_lens, heads=4, kv_heads=2, width=8, page=4, pages_per_row=6, tokens=None,
                 pad_requests=1, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        n = len(q_lens)
        pool = 1 + n * pages_per_row  # page 0 is the null block
        self.q_lens, self.k_lens, self.heads, self.kv_heads, self.width = q_lens, k_lens, heads, kv_heads, width
        self.k_pool = torch.randn(pool, page, kv_heads, width, generator=g).to(dtype)
        self.v_pool = torch.randn(pool, page, kv_heads, width, generator=g).to(dtype)
        pages = (torch.randperm(pool - 1, generator=g) + 1).int()
        table = torch.zeros(n + pad_requests, pages_per_row, dtype=torch.int32)
        for r in range(n):
            used = -(-k_lens[r] // page)
            table[r, :used] = pages[r * pages_per_row: r * pages_per_row + used]
        self.table = table
        real = sum(q_lens)
        self.tokens = tokens or real
        self.q = torch.randn(self.tokens, heads, width, generator=g).to(dtype)
        starts = [0]
        for lq in q_lens:
            starts.append(starts[-1] + lq)
        self.cu = torch.tensor(starts + [real] * pad_requests, dtype=torch.int32)
        self.used = torch.tensor(list(k_lens) + [0] * pad_requests, dtype=torch.int32)
        self.real = real

    def keys(self, pool):
        return torch.cat([pool[self.table[r].long()].reshape(-1, self.kv_heads, self.width)[:lk]
                          for r, lk in enumerate(self.k_lens)])

    def attend(self, window=(-1, 0), scale=None, lse=False):
        aux = AuxRequest(lse=True) if lse else None
        return varlen_attn(self.q.to("tpu"), self.k_pool.to("tpu"), self.v_pool.to("tpu"), self.cu.to("tpu"), None,
                           self.tokens, self.k_pool.shape[0] * self.k_pool.shape[1], return_aux=aux, scale=scale,
                           window_size=window, enable_gqa=self.heads != self.kv_heads,
                           seqused_k=self.used.to("tpu"), block_table=self.table.to("tpu"))

    def reference(self, window=(-1, 0), scale=None):
        return reference(self.q[:self.real].float(), self.keys(self.k_pool).float(), self.keys(self.v_pool).float(),
                         self.q_lens, self.k_lens, left=window[0], right=window[1], scale=scale)


# Decodes (one query over many keys), prefill chunks (fewer queries than keys: a prefix-cache hit or a chunked
# prefill), a whole prefill, and a request of more queries than the kernel's query block.
MIXED = dict(q_lens=[1, 5, 1, 11, 3], k_lens=[9, 12, 1, 11, 21], tokens=24)


@pytest.mark.parametrize("window,gqa", [((-1, 0), True), ((-1, 0), False), ((3, 0), True), ((-1, -1), True),
                                        ((2, 1), False)])
def test_kernel_matches_portable_lowering_and_float64_reference(kernel, window, gqa):
    step = Step(**MIXED, kv_heads=2 if gqa else 4, seed=1)
    portable, portable_lse = (t.cpu() for t in step.attend(window, scale=0.3, lse=True))
    calls = ak.kernel_calls()
    # Small blocks: several query blocks in a request, several key blocks of two pages.
    kernel(functools.partial(ak.ragged_paged_attention, queries_per_block=4, keys_per_block=8))
    out, lse = (t.cpu() for t in step.attend(window, scale=0.3, lse=True))
    assert ak.kernel_calls() == calls + 1
    ref, ref_lse = step.reference(window, scale=0.3)
    n = step.real
    torch.testing.assert_close(out[:n], ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[:, :n], ref_lse.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, portable, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, portable_lse, rtol=1e-5, atol=1e-5)
    # Bucket padding: tokens of no request see no key, as in the portable lowering.
    assert (out[n:] == 0).all() and torch.isinf(lse[:, n:]).all()


def test_default_kernel_scale_and_half_precision(kernel):
    step = Step(**MIXED, dtype=torch.bfloat16, width=16, seed=2)
    portable = step.attend().cpu()
    assert kernel() is ak.ragged_paged_attention  # default fn, default block sizes, default scale 1/sqrt(16)
    out = step.attend().cpu()
    assert out.dtype == torch.bfloat16
    ref, _ = step.reference()
    torch.testing.assert_close(out[:step.real].float(), ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), portable.float(), rtol=2e-2, atol=2e-2)


def _ran(fn):
    """Names of the ops dispatched while fn() ran (the profiler's op events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_the_registered_kernel_is_the_one_that_runs_on_its_platform_only(kernel):
    step = Step(**MIXED, seed=3)

    def marker(query, key_pages, value_pages, cu_seq_q, seqused_k, block_table, *, scale, window_left,
               window_right):
        return jnp.full(query.shape, 7.0, query.dtype)  # no lse: the op's is NaN

    # A kernel for another plugin's platform is kept apart: this process's calls stay portable.
    kernel(marker, platform=OTHER)
    assert ak.attention_kernel(OTHER) is marker and ak.attention_kernel() is None
    ops = _ran(lambda: step.attend().cpu())
    assert "aten::_flash_attention_forward" in ops and "torch_pjrt::jax_call" not in ops

    kernel(marker)
    out = {}
    ops = _ran(lambda: out.update(zip(("out", "lse"), (t.cpu() for t in step.attend(lse=True)))))
    assert "torch_pjrt::jax_call" in ops and "aten::_flash_attention_forward" not in ops
    assert (out["out"] == 7).all() and torch.isnan(out["lse"]).all()

    # Registering again replaces the kernel, also for argument types already lowered.
    kernel()
    torch.testing.assert_close(step.attend().cpu()[:step.real], step.reference()[0].float(), rtol=1e-5, atol=1e-5)

    # Unregistered: the portable lowering again, autograd of the packed (not paged) form included.
    assert ak.unregister_attention_kernel() is ak.ragged_paged_attention
    ops = _ran(lambda: step.attend().cpu())
    assert "aten::_flash_attention_forward" in ops and "torch_pjrt::jax_call" not in ops
    q = torch.randn(6, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    dq = q.to("tpu")
    varlen_attn(dq, dq, dq, cu.to("tpu"), cu.to("tpu"), 4, 4, window_size=(-1, 0)).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.modes_inside  # picks fused mode itself
def test_backend_forward_is_one_fused_program_with_the_kernel(kernel):
    pytest.importorskip("vllm")
    from torch_pjrt.vllm.attention import TpuAttentionImpl, TpuAttentionMetadata

    heads, kv_heads, width, page = 4, 2, 8, 4
    step = Step(**MIXED, heads=heads, kv_heads=kv_heads, width=width, page=page, seed=4)
    impl = TpuAttentionImpl(num_heads=heads, head_size=width, scale=0.3, num_kv_heads=kv_heads)
    g = torch.Generator().manual_seed(5)
    # This step's keys and values: the last q_len of each request's keys, written by slot into the cache.
    slots = torch.zeros(step.tokens, dtype=torch.int64)  # padded tokens write the null block's row 0
    for r, (lq, lk) in enumerate(zip(step.q_lens, step.k_lens)):
        for i in range(lq):
            pos = lk - lq + i
            slots[step.cu[r] + i] = int(step.table[r, pos // page]) * page + pos % page
    key = torch.randn(step.tokens, kv_heads, width, generator=g)
    value = torch.randn(step.tokens, kv_heads, width, generator=g)
    w = torch.randn(heads * width, 16, generator=g)
    meta = TpuAttentionMetadata(num_actual_tokens=step.tokens, max_query_len=max(step.q_lens),
                                max_seq_len=max(step.k_lens), query_start_loc=step.cu.to("tpu"),
                                seq_lens=step.used.to("tpu"), block_table=step.table.to("tpu"),
                                slot_mapping=slots.to("tpu"))

    def run():
        cache = torch.stack([step.k_pool, step.v_pool]).to("tpu")
        output = torch.empty(step.tokens, heads, width, device="tpu")
        out = impl.forward(None, step.q.to("tpu"), key.to("tpu"), value.to("tpu"), cache, meta, output)
        return (out.reshape(step.tokens, -1) @ w.to("tpu")).cpu(), cache.cpu()

    with torch_pjrt.mode("fused"), torch.no_grad():
        portable, portable_cache = run()
        kernel()
        run()  # compiles
        torch_pjrt.sync()
        torch_pjrt.reset_metrics()
        calls = ak.kernel_calls()
        got, cache = run()
        m = torch_pjrt.metrics()
    assert ak.kernel_calls() == calls + 1
    assert m["cpu_fallbacks"] == {}, m["cpu_fallbacks"]
    assert m["compiles"] == 0
    # The cache write, the kernel and the projection: one program (the inputs' uploads are no programs).
    assert m["executions"] == 1, m
    torch.testing.assert_close(cache, portable_cache)
    torch.testing.assert_close(got, portable, rtol=1e-5, atol=1e-5)
    # And against float64 attention over the written cache.
    written = Step(**MIXED, heads=heads, kv_heads=kv_heads, width=width, page=page, seed=4)
    written.k_pool, written.v_pool = cache[0], cache[1]
    ref, _ = written.reference(scale=0.3)
    torch.testing.assert_close(got[:step.real], ref.float().reshape(step.real, -1) @ w, rtol=1e-4, atol=1e-4)


def test_vllm_setting_names_the_kernel(kernel):
    assert ak.kernel_from_setting(None) is None and ak.kernel_from_setting("portable") is None
    assert ak.kernel_from_setting("jax") is ak.ragged_paged_attention
    name = "torch_pjrt.vllm.attention_kernels:pallas_ragged_paged_attention"
    assert ak.kernel_from_setting(name) is ak.pallas_ragged_paged_attention
    with pytest.raises(ValueError, match="torch_pjrt_attention_kernel"):
        ak.kernel_from_setting("fast")
    assert ak.apply_vllm_setting({}) is None and ak.attention_kernel() is None
    assert ak.apply_vllm_setting({"torch_pjrt_attention_kernel": "jax"}) is ak.ragged_paged_attention
    assert ak.attention_kernel() is ak.ragged_paged_attention


@pytest.mark.parametrize("window_left", [-1, 4])
def test_pallas_adapter_layout_against_jax_reference(window_left):
    """pallas_ragged_paged_attention's layout work (combined K/V pool, num_seqs, sliding window) with the Pallas
    kernel replaced by jax's reference of the same contract (eager JAX on the CPU). The Pallas kernel itself
    needs a TPU and is not run here."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    step = Step(**MIXED, seed=6)
    args = [jnp.asarray(t.numpy()) for t in (step.q, step.k_pool, step.v_pool, step.cu, step.used, step.table)]
    got = ak.pallas_ragged_paged_attention(*args, scale=0.3, window_left=window_left, window_right=0,
                                           kernel=ref_ragged_paged_attention)
    want, _ = ak.ragged_paged_attention(*args, scale=0.3, window_left=window_left, window_right=0)
    n = step.real
    torch.testing.assert_close(torch.from_numpy(jax.device_get(got)[:n].copy()),
                               torch.from_numpy(jax.device_get(want)[:n].copy()), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="causal"):
        ak.pallas_ragged_paged_attention(*args, scale=0.3, window_left=-1, window_right=-1,
                                         kernel=ref_ragged_paged_attention)
