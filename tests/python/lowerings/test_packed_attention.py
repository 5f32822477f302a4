"""Attention over packed and paged sequences (packed_attention.cpp): torch.nn.attention.varlen.varlen_attn and
the flash-attention ops under it, which have no CPU kernel, against a float64 reference written per sequence."""
import math

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

import torch_pjrt


def reference(q, k, v, q_lens, k_lens, causal=False, left=-1, right=-1, scale=None):
    """Flash attention's result per sequence, in float64: packed q [Tq, H, D], k and v [Tk, Hkv, D]; query i
    of a sequence sees key j when j <= i + Lk - Lq + right and j >= i + Lk - Lq - left (causal: right = 0).
    Returns the output and the log-sum-exp [H, Tq] (+inf for a query that sees no key)."""
    q, k, v = q.double(), k.double(), v.double()
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    right = 0 if causal else right
    outs, lses, qs, ks = [], [], 0, 0
    for lq, lk in zip(q_lens, k_lens):
        i = torch.arange(lq)[:, None] + lk - lq
        j = torch.arange(lk)[None, :]
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            seen &= j <= i + right
        if left >= 0:
            seen &= j >= i - left
        s = torch.einsum("qhd,khd->hqk", q[qs:qs + lq], k[ks:ks + lk]) * scale
        s = s.masked_fill(~seen, -math.inf)
        lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is seen
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        outs.append(torch.einsum("hqk,khd->qhd", p, v[ks:ks + lk]))
        lses.append(lse.masked_fill(lse == -math.inf, math.inf))
        qs, ks = qs + lq, ks + lk
    return torch.cat(outs), torch.cat(lses, dim=1)


def cumulative(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def packed(lens, heads, width, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lens), heads, width, generator=g)


@pytest.mark.parametrize("window,gqa", [((-1, 0), False), ((-1, 0), True), ((-1, -1), False), ((2, 0), True),
                                        ((1, 1), False)])
def test_varlen_attn_forward_and_backward_match_per_sequence_attention(window, gqa):
    lens = [3, 5, 1, 4]
    heads, kv_heads, width = 4, (2 if gqa else 4), 8
    q, k, v = packed(lens, heads, width, 0), packed(lens, kv_heads, width, 1), packed(lens, kv_heads, width, 2)
    cu = cumulative(lens)
    leaves = [t.to("tpu").requires_grad_() for t in (q, k, v)]
    out = varlen_attn(*leaves, cu.to("tpu"), cu.to("tpu"), max(lens), max(lens), window_size=window, enable_gqa=gqa)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    out.backward(grad.to("tpu"))

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*ref_leaves, lens, lens, left=window[0], right=window[1])
    ref.backward(grad.double())
    torch.testing.assert_close(out.cpu(), ref.float(), rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.cpu(), want.grad.float(), rtol=1e-4, atol=1e-5)


def test_fewer_queries_than_keys_align_bottom_right_and_empty_rows_are_zero():
    # Sequence 0: 3 queries, 1 key, causal: its first two queries see no key (zeros, log-sum-exp +inf).
    q_lens, k_lens = [3, 2, 4], [1, 6, 4]
    q, k, v = packed(q_lens, 2, 8, 4), packed(k_lens, 2, 8, 5), packed(k_lens, 2, 8, 6)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q.to("tpu"), k.to("tpu"), v.to("tpu"), cumulative(q_lens).to("tpu"), cumulative(k_lens).to("tpu"),
        max(q_lens), max(k_lens), 0.0, True, False, scale=0.3)
    ref, ref_lse = reference(q, k, v, q_lens, k_lens, causal=True, scale=0.3)
    torch.testing.assert_close(out.cpu(), ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse.float(), rtol=1e-5, atol=1e-5)
    assert torch.isinf(lse.cpu()[:, :2]).all() and (out.cpu()[:2] == 0).all()


def test_paged_keys_through_a_block_table_with_seqused_k():
    # A pool of 7 pages of 4 slots; sequence 0 holds 6 keys on pages 5, 2; sequence 1 holds 3 keys on page 0;
    # sequence 2 holds 9 on pages 6, 1, 3. A decode step (one query each) and a prefill chunk (the last keys).
    page, kv_heads, heads, width = 4, 2, 4, 8
    g = torch.Generator().manual_seed(7)
    k_pool, v_pool = torch.randn(7, page, kv_heads, width, generator=g), torch.randn(7, page, kv_heads, width, generator=g)
    table = torch.tensor([[5, 2, 0], [0, 4, 4], [6, 1, 3]], dtype=torch.int32)  # unused entries are any page
    used = [6, 3, 9]

    def keys_of(pool, s):
        return pool[table[s].long()].reshape(-1, kv_heads, width)[:used[s]]

    k = torch.cat([keys_of(k_pool, s) for s in range(3)])
    v = torch.cat([keys_of(v_pool, s) for s in range(3)])
    for q_lens in ([1, 1, 1], [2, 3, 4]):
        q = packed(q_lens, heads, width, 8)
        out = varlen_attn(q.to("tpu"), k_pool.to("tpu"), v_pool.to("tpu"), cumulative(q_lens).to("tpu"),
                          cumulative(used).to("tpu"), max(q_lens), max(used), window_size=(-1, 0), enable_gqa=True,
                          seqused_k=torch.tensor(used, dtype=torch.int32).to("tpu"), block_table=table.to("tpu"))
        ref, _ = reference(q, k, v, q_lens, used, causal=True)
        torch.testing.assert_close(out.cpu(), ref.float(), rtol=1e-5, atol=1e-5)


def test_a_batch_without_packing_matches_scaled_dot_product_attention():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g) for _ in range(3))  # (B, S, H, D)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(q.to("tpu"), k.to("tpu"), v.to("tpu"), None, None, 5, 5,
                                                           0.0, True, False)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    assert lse.shape == (2, 4, 5)


def test_bf16_rounds_once_from_float32_math():
    lens = [4, 6]
    q, k, v = (packed(lens, 2, 16, s).bfloat16() for s in (10, 11, 12))
    cu = cumulative(lens).to("tpu")
    out = varlen_attn(q.to("tpu"), k.to("tpu"), v.to("tpu"), cu, cu, 6, 6, window_size=(-1, 0))
    ref, _ = reference(q.float(), k.float(), v.float(), lens, lens, causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_no_cpu_fallback_and_one_program_for_new_lengths():
    # The lengths are runtime operands: other lengths with the same token count run the same program.
    torch_pjrt.sync()
    before = torch_pjrt.metrics()
    for lens in ([3, 5], [6, 2], [1, 7]):
        q = packed(lens, 2, 8, 13).to("tpu")
        cu = cumulative(lens).to("tpu")
        varlen_attn(q, q, q, cu, cu, 8, 8, window_size=(-1, 0)).cpu()
    after = torch_pjrt.metrics()
    assert after["cpu_fallbacks"] == before["cpu_fallbacks"]
    assert after["compiles"] - before["compiles"] <= 1


def test_varlen_attn_out_writes_the_output_in_place():
    from torch.nn.attention.varlen import varlen_attn_out
    lens = [2, 5]
    q, k, v = (packed(lens, 2, 8, s) for s in (14, 15, 16))
    cu = cumulative(lens).to("tpu")
    out = torch.full(q.shape, float("nan"), device="tpu")
    varlen_attn_out(out, q.to("tpu"), k.to("tpu"), v.to("tpu"), cu, cu, 5, 5, window_size=(-1, 0))
    ref, _ = reference(q, k, v, lens, lens, causal=True)
    torch.testing.assert_close(out.cpu(), ref.float(), rtol=1e-5, atol=1e-5)


def test_arguments_without_a_lowering_name_the_reason_not_the_cpu_backend():
    # The flash kernel's ALiBi slopes have no lowering, and the op has no CPU kernel to fall back to.
    q = torch.randn(6, 2, 8, device="tpu")
    cu = cumulative([2, 4]).to("tpu")
    with pytest.raises(NotImplementedError, match="alibi slopes.*no CPU kernel"):
        torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, True, False,
                                                alibi_slopes=torch.ones(2, device="tpu"))
