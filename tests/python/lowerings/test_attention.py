"""scaled_dot_product_attention on tpu: inference calls take one fused attention op
(`_scaled_dot_product_fused_attention_overrideable`, lowerings/attention.cpp), training keeps PyTorch's math path.

Checked against CPU PyTorch: dtypes, masks (bool, additive, broadcast), causal masking with more or fewer queries
than keys, an explicit scale, grouped-query heads, rows masked everywhere, NaN inputs; that gradients still flow
(math path); that `sdpa_kernel(MATH)` is obeyed; and that a key/value cache grown by `torch.cat` one token per step
(transformers' dynamic cache) reads padded to its capacity: the CPU's values at every length, nothing compiled
inside a capacity bucket.
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import torch_pjrt
from conftest import assert_matches_cpu

pytestmark = pytest.mark.modes_inside  # runs its modes itself

FUSED_OP = "aten::_scaled_dot_product_fused_attention_overrideable"
MODES = ["fused", "strict", "lazy"]


def fused_calls():
    return torch_pjrt.metrics()["lowered_ops"].get(FUSED_OP, 0)


def compiles():
    return torch_pjrt.metrics()["compiles"]


def sdpa(q, k, v, mask=None, **kw):
    with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


CASES = {
    "plain": lambda d: ((rand(2, 4, 3, 8, dtype=d), rand(2, 4, 5, 8, dtype=d, seed=1), rand(2, 4, 5, 6, dtype=d, seed=2)), {}),
    "causal, fewer queries": lambda d: ((rand(1, 2, 3, 8, dtype=d), rand(1, 2, 5, 8, dtype=d, seed=1),
                                         rand(1, 2, 5, 8, dtype=d, seed=2)), dict(is_causal=True)),
    "causal, more queries": lambda d: ((rand(1, 2, 6, 8, dtype=d), rand(1, 2, 4, 8, dtype=d, seed=1),
                                        rand(1, 2, 4, 8, dtype=d, seed=2)), dict(is_causal=True)),
    "scale": lambda d: ((rand(1, 2, 3, 8, dtype=d), rand(1, 2, 5, 8, dtype=d, seed=1), rand(1, 2, 5, 8, dtype=d, seed=2)),
                        dict(scale=0.3)),
    "grouped heads": lambda d: ((rand(2, 6, 3, 8, dtype=d), rand(2, 2, 5, 8, dtype=d, seed=1),
                                 rand(2, 2, 5, 8, dtype=d, seed=2)), dict(enable_gqa=True)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_cpu(case, dtype, mode):
    args, kw = CASES[case](dtype)
    before = fused_calls()
    with torch_pjrt.mode(mode):
        assert_matches_cpu(lambda q, k, v: sdpa(q, k, v, **kw), *args)
    assert fused_calls() > before  # the fused op ran, not the math path


def masks():
    g = torch.Generator().manual_seed(3)
    bool_mask = torch.rand(3, 5, generator=g) > 0.4
    bool_mask[1] = False  # a row masked everywhere: zeros, as the CPU gives
    additive = torch.randn(2, 1, 3, 5, generator=g)
    additive[0, 0, 2] = float("-inf")
    per_head = torch.rand(1, 4, 1, 5, generator=g) > 0.3
    return {"bool [L, S], a row all False": bool_mask, "additive [B, 1, L, S], a row all -inf": additive,
            "bool [1, H, 1, S]": per_head}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(masks()))
def test_attention_masks_match_cpu(name, mode):
    mask = masks()[name]
    q, k, v = rand(2, 4, 3, 8), rand(2, 4, 5, 8, seed=1), rand(2, 4, 5, 8, seed=2)
    before = fused_calls()
    with torch_pjrt.mode(mode):
        assert_matches_cpu(sdpa, q, k, v, mask)
    assert fused_calls() > before


def test_nan_propagates_as_on_cpus_math_path():
    # The CPU's two kernels disagree on a query row that is NaN everywhere: its flash kernel gives zeros (its running
    # max skips NaN), its math path (and the flash kernel with a mask) NaN. The device follows the math path: a NaN
    # input never turns into a number. A NaN key or an inf value gives what both CPU kernels give.
    q, k, v = rand(1, 2, 3, 8), rand(1, 2, 5, 8, seed=1), rand(1, 2, 5, 8, seed=2)
    q[0, 1, 2, 0] = float("nan")
    k[0, 0, 3, 1] = float("nan")
    v[0, 1, 4, 1] = float("inf")
    with sdpa_kernel([SDPBackend.MATH]):
        expected = sdpa(q, k, v)
    got = sdpa(q.to("tpu"), k.to("tpu"), v.to("tpu")).cpu()
    torch.testing.assert_close(got, expected, equal_nan=True)
    assert got[0, 1, 2].isnan().all()


def test_training_keeps_the_math_path_and_its_gradients():
    q, k, v = (rand(2, 2, 3, 8, seed=s).requires_grad_() for s in range(3))

    def loss(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        return (out.detach(), *grads)

    before = fused_calls()
    assert_matches_cpu(loss, q, k, v)
    assert fused_calls() == before  # autograd needs the math path's backward


def test_sdpa_kernel_math_is_obeyed():
    q, k, v = rand(1, 2, 3, 8), rand(1, 2, 5, 8, seed=1), rand(1, 2, 5, 8, seed=2)
    before = fused_calls()
    with sdpa_kernel([SDPBackend.MATH]):
        assert_matches_cpu(sdpa, q, k, v)
    assert fused_calls() == before


# ---- a cache grown by torch.cat, a token per step (transformers' DynamicCache) ------------------------------


def decode_steps(q_steps, k_new, v_new, k0, v0, mask_steps=None):
    """For each step: k, v = cat([k, k_new[step]], -2), then attention of that step's query over the cache."""
    k, v, outs = k0, v0, []
    for step in range(q_steps.shape[0]):
        with torch.no_grad():
            k = torch.cat([k, k_new[step]], dim=-2)
            v = torch.cat([v, v_new[step]], dim=-2)
            mask = None if mask_steps is None else mask_steps[step][..., : k.shape[-2]]
            out = F.scaled_dot_product_attention(q_steps[step], k, v, attn_mask=mask,
                                                 enable_gqa=q_steps.shape[2] != k.shape[1])
        outs.append(out.cpu())  # read every step, as a decoding loop reads its token
    return outs


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("batch,heads,kv_heads", [(1, 2, 2), (2, 4, 2)])
def test_growing_cache_matches_cpu_and_compiles_once_per_bucket(batch, heads, kv_heads, mode):
    steps, width, start = 40, 16, 3
    q_steps = rand(steps, batch, heads, 1, width)
    k_new, v_new = rand(steps, batch, kv_heads, 1, width, seed=1), rand(steps, batch, kv_heads, 1, width, seed=2)
    k0, v0 = rand(batch, kv_heads, start, width, seed=3), rand(batch, kv_heads, start, width, seed=4)
    expected = decode_steps(q_steps, k_new, v_new, k0, v0)
    with torch_pjrt.mode(mode):
        dev = [t.to("tpu") for t in (q_steps, k_new, v_new, k0, v0)]
        decode_steps(*dev)  # warm-up: every bucket the lengths cross
        torch.tpu.synchronize()
        before_compiles, before_calls = compiles(), fused_calls()
        got = decode_steps(*dev)
        new = compiles() - before_compiles
        assert fused_calls() - before_calls == steps
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert new == 0, torch_pjrt.explain()


def test_growing_cache_with_a_mask_matches_cpu():
    # A mask over the true keys is padded to the cache's capacity; its padding lanes never count.
    steps, width = 20, 8
    q_steps = rand(steps, 2, 2, 1, width)
    k_new, v_new = rand(steps, 2, 2, 1, width, seed=1), rand(steps, 2, 2, 1, width, seed=2)
    k0, v0 = rand(2, 2, 2, width, seed=3), rand(2, 2, 2, width, seed=4)
    mask_steps = rand(steps, 2, 1, 1, 2 + steps, seed=5) > -0.5
    expected = decode_steps(q_steps, k_new, v_new, k0, v0, mask_steps)
    got = decode_steps(*[t.to("tpu") for t in (q_steps, k_new, v_new, k0, v0, mask_steps)])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_cache_padding_holding_inf_and_nan_never_leaks():
    # Lanes past the true length hold other rows' values: here inf and NaN, in rows the query never reads.
    k0, v0 = rand(2, 2, 4, 8, seed=3), rand(2, 2, 4, 8, seed=4)
    v0[1] = float("inf")
    k0[1, 1] = float("nan")
    q = rand(1, 2, 1, 8)

    def step(q, k0, v0, k1, v1):
        with torch.no_grad():
            k = torch.cat([torch.cat([k0, k1], -2), k1], -2)  # the second cat extends a grown storage
            v = torch.cat([torch.cat([v0, v1], -2), v1], -2)
            return F.scaled_dot_product_attention(q, k[:1], v[:1])

    assert_matches_cpu(step, q, k0, v0, rand(2, 2, 1, 8, seed=5), rand(2, 2, 1, 8, seed=6))


def test_direct_calls_outside_the_fused_ops_cases_raise():
    # sdp_choice.cpp never sends these; a direct call must fail loudly, not compute something else.
    q = rand(1, 2, 3, 8).to("tpu")
    op = torch.ops.aten._scaled_dot_product_fused_attention_overrideable
    for kw in [dict(dropout_p=0.5), dict(is_causal=True, attn_bias=torch.zeros(3, 3, device="tpu"))]:
        with pytest.raises(NotImplementedError):
            op(q, q, q, **kw)
    with pytest.raises(NotImplementedError):
        op(q[0], q[0], q[0])
