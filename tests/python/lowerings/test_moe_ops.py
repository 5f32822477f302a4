"""Mixture-of-experts ops on tpu against the CPU: index_add, histc (integers
against a NumPy reference of CUDA's rule, since the CPU kernel rejects them),
bincount, torch._grouped_mm, the data-dependent nonzero / masked_select /
boolean-mask indexing, and a tiny transformers MoE model training 3 steps."""
import numpy as np
import pytest
import torch

import torch_pjrt
from conftest import assert_matches_cpu


def no_fallbacks():
    fallbacks = torch_pjrt.metrics()["cpu_fallbacks"]
    assert not fallbacks, fallbacks


@pytest.fixture(autouse=True)
def _reset():
    torch_pjrt.reset_metrics()


# ---- repeat_interleave with output_size (torchtitan's MoE routing) ----

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("repeats", [[2, 0, 3, 1], [0, 0, 5], [1], [4, 4, 4, 4, 4, 4, 4, 4]])
def test_repeat_interleave_with_output_size(dtype, repeats):
    r = torch.tensor(repeats, dtype=dtype)
    total = int(r.sum())
    assert_matches_cpu(lambda t: torch.repeat_interleave(t, output_size=total), r)
    x = torch.randn(len(repeats), 3)
    assert_matches_cpu(lambda a, t: torch.repeat_interleave(a, t, dim=0, output_size=total), x, r)
    no_fallbacks()


def test_repeat_interleave_with_a_wrong_output_size_raises_like_cpu():
    r = torch.tensor([2, 0, 3, 1])
    for wrong in (5, 7):  # the repeats must add up to output_size exactly
        with pytest.raises(RuntimeError, match="allocated size does not match required size"):
            torch.repeat_interleave(r, output_size=wrong)
        with pytest.raises(RuntimeError, match="allocated size does not match required size"):
            torch.repeat_interleave(r.to("tpu"), output_size=wrong).cpu()
    torch.tpu.synchronize()


# ---- index_add ----

@pytest.mark.parametrize("dtype,dim", [(torch.float32, 0), (torch.float32, 1), (torch.float32, -1), (torch.bfloat16, 1),
                                       (torch.int32, 0), (torch.int64, -1), (torch.bool, 1), (torch.float64, 0)])
def test_index_add(dtype, dim):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 5, 3, generator=gen) * 5).to(dtype)
    index = torch.tensor([1, 0, 2, 1])  # repeats accumulate
    src_shape = [4, 5, 3]
    src_shape[dim] = 4
    src = (torch.randn(src_shape, generator=gen) * 5).to(dtype)
    alpha = True if dtype == torch.bool else 3
    assert_matches_cpu(lambda a, i, s: a.index_add(dim, i, s, alpha=alpha), x, index, src)
    assert_matches_cpu(lambda a, i, s: a.clone().index_add_(dim, i, s), x, index, src)
    no_fallbacks()


def test_index_add_edge_cases():
    assert_matches_cpu(lambda a, i, s: a.index_add(0, i, s), torch.zeros(3, 2), torch.zeros(0, dtype=torch.long),
                       torch.zeros(0, 2))
    assert_matches_cpu(lambda a, i, s: a.index_add(0, i, s), torch.zeros(()), torch.tensor([0]), torch.ones(()))
    assert_matches_cpu(lambda a, i, s: a.index_add(0, i, s), torch.zeros(5), torch.tensor([4, 4, 0], dtype=torch.int32),
                       torch.ones(3))
    no_fallbacks()


@pytest.mark.parametrize("shape,dim,bad,error", [((3,), 0, 5, IndexError), ((3, 2), 0, -1, RuntimeError),
                                                 ((3, 4), 1, 4, RuntimeError)])
def test_index_add_out_of_range_raises_like_cpu(shape, dim, bad, error):
    src_shape = list(shape)
    src_shape[dim] = 1
    args = (dim, torch.tensor([bad]), torch.ones(src_shape))
    with pytest.raises(error) as cpu:
        torch.zeros(shape).index_add_(*args)
    with pytest.raises(error) as dev:
        torch.zeros(shape, device="tpu").index_add_(args[0], args[1].to("tpu"), args[2].to("tpu"))
        torch.tpu.synchronize()
    assert str(cpu.value).split(" (")[0] in str(dev.value)


# ---- histc ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bins,lo,hi", [(10, 0, 0), (4, -1, 1), (7, 0.5, 2.5), (1, 0, 0), (3, -2, 2)])
def test_histc_float(dtype, bins, lo, hi):
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.0, 2.0, 2.5, 3.0, float("nan")], dtype=dtype)
    if lo == hi:
        x = x[:-1]  # the data range of a NaN is not finite
    assert_matches_cpu(lambda a: torch.histc(a, bins=bins, min=lo, max=hi), x)
    # bin edges exactly: (x - min) * bins / (max - min) on an integer boundary
    assert_matches_cpu(lambda a: torch.histc(a, bins=4, min=0, max=4), torch.arange(5, dtype=dtype))
    no_fallbacks()


def test_histc_edge_cases():
    assert_matches_cpu(lambda a: torch.histc(a, bins=5), torch.full((6,), 3.0))  # min == max of the data
    assert_matches_cpu(lambda a: torch.histc(a, bins=5), torch.zeros(0))
    assert_matches_cpu(lambda a: torch.histc(a, bins=3, min=5, max=6), torch.tensor([1.0, 2.0]))  # all outside
    gen = torch.Generator().manual_seed(0)
    assert_matches_cpu(lambda a: torch.histc(a, bins=17), torch.randn(1000, generator=gen))
    no_fallbacks()
    with pytest.raises(RuntimeError, match="max must be larger than min"):
        torch.histc(torch.ones(3, device="tpu"), bins=3, min=2, max=1)
    with pytest.raises(RuntimeError, match="not finite"):
        torch.histc(torch.tensor([1.0, float("inf")], device="tpu"), bins=3).cpu()


def histc_cuda_rule(x, bins, lo, hi):
    """CUDA's integer histc: edges from the data when min == max, then
    bin = (v - min) * bins // (max - min), v == max in the last bin."""
    v = x.numpy().astype(np.int64).ravel()
    lo, hi = int(lo), int(hi)
    if lo == hi and v.size:
        lo, hi = int(v.min()), int(v.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    out = np.zeros(bins, dtype=np.int64)
    for e in v:
        if lo <= e <= hi:
            out[min((e - lo) * bins // (hi - lo), bins - 1)] += 1
    return torch.from_numpy(out).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int16, torch.uint8])
@pytest.mark.parametrize("bins,lo,hi", [(4, 0, 0), (3, 0, 10), (8, 2, 5), (1, 0, 0)])
def test_histc_integers_follow_cuda(dtype, bins, lo, hi):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 12, (40,), generator=gen).to(dtype)
    got = torch.histc(x.to("tpu"), bins=bins, min=lo, max=hi).cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got, histc_cuda_rule(x, bins, lo, hi))
    same = torch.full((5,), 7, dtype=dtype)  # min == max of the data
    torch.testing.assert_close(torch.histc(same.to("tpu"), bins=bins).cpu(), histc_cuda_rule(same, bins, 0, 0))
    no_fallbacks()


# ---- bincount ----

@pytest.mark.parametrize("dtype,weights,minlength", [
    (torch.int64, None, 0), (torch.int32, None, 20), (torch.uint8, None, 3), (torch.int64, torch.float32, 0),
    (torch.int32, torch.float64, 20), (torch.int64, torch.int32, 3), (torch.uint8, torch.float16, 0)])
def test_bincount(dtype, weights, minlength):
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 9, (30,), generator=gen).to(dtype)
    w = None if weights is None else (torch.randn(30, generator=gen) * 4).to(weights)
    assert_matches_cpu(lambda a, b: torch.bincount(a, b, minlength=minlength), x, w)
    assert_matches_cpu(lambda a: torch.bincount(a, minlength=minlength), torch.zeros(0, dtype=dtype))
    no_fallbacks()


def test_bincount_rejects_like_cpu():
    with pytest.raises(RuntimeError, match="non-negative"):
        torch.bincount(torch.tensor([1, -1], device="tpu"))
    with pytest.raises(RuntimeError):
        torch.bincount(torch.ones(2, 2, dtype=torch.long, device="tpu"))


# ---- _grouped_mm ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_2d_3d(dtype):
    gen = torch.Generator().manual_seed(3)
    a, w = torch.randn(10, 16, generator=gen).to(dtype), torch.randn(4, 16, 8, generator=gen).to(dtype)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # an empty group
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    assert_matches_cpu(lambda a, w, o: torch._grouped_mm(a, w, o), a, w, offs, **tol)
    no_fallbacks()


def test_grouped_mm_other_layouts_and_backward():
    gen = torch.Generator().manual_seed(4)
    offs = torch.tensor([4, 4, 12, 16], dtype=torch.int32)
    # 2d x 2d: groups along K -> [G, M, N]
    assert_matches_cpu(lambda a, b, o: torch._grouped_mm(a, b, o), torch.randn(8, 16, generator=gen).t().contiguous().t(),
                       torch.randn(16, 8, generator=gen), offs, atol=1e-4, rtol=1e-4)
    # 3d x 2d: groups along N -> [M, N]
    assert_matches_cpu(lambda a, b, o: torch._grouped_mm(a, b, o), torch.randn(4, 8, 16, generator=gen),
                       torch.randn(8, 16, generator=gen).t(), torch.tensor([2, 2, 6, 8], dtype=torch.int32),
                       atol=1e-4, rtol=1e-4)
    # 3d x 3d: batched
    assert_matches_cpu(lambda a, b: torch._grouped_mm(a, b), torch.randn(3, 8, 16, generator=gen),
                       torch.randn(3, 16, 8, generator=gen), atol=1e-4, rtol=1e-4)
    # autograd of 2d x 3d (its backward uses the 2d x 2d form)
    a, w = torch.randn(16, 8, generator=gen, requires_grad=True), torch.randn(4, 8, 16, generator=gen, requires_grad=True)

    def grads(a, w, o):
        torch._grouped_mm(a, w, o).square().sum().backward()
        return a.grad, w.grad
    assert_matches_cpu(grads, a, w, offs, atol=1e-3, rtol=1e-4)
    no_fallbacks()


# ---- data-dependent shapes ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 2), ()])
def test_nonzero_and_masked_select(dtype, shape):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(shape, generator=gen) > 0.3).to(dtype) * torch.randint(1, 5, shape, generator=gen).to(dtype)
    assert_matches_cpu(torch.nonzero, x)
    assert_matches_cpu(lambda a: a.nonzero(as_tuple=True), x)
    mask = torch.randn(shape, generator=gen) > 0
    assert_matches_cpu(torch.masked_select, x, mask)
    no_fallbacks()


def test_data_dependent_edge_cases():
    assert_matches_cpu(torch.nonzero, torch.zeros(3, 4))  # no nonzero element
    assert_matches_cpu(torch.nonzero, torch.zeros(0, 4))
    assert_matches_cpu(torch.masked_select, torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.bool))  # all-false
    assert_matches_cpu(torch.masked_select, torch.randn(3, 4), torch.tensor([True, False, True, True]))  # broadcast
    assert_matches_cpu(torch.nonzero, torch.ones(5, 5))
    no_fallbacks()


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool, torch.int32])
def test_unique(dtype):
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 5, (3, 7), generator=gen).to(dtype)
    for kw in [dict(), dict(return_inverse=True), dict(return_counts=True), dict(return_inverse=True, return_counts=True)]:
        assert_matches_cpu(lambda a: torch.unique(a, **kw), x)
    assert_matches_cpu(lambda a: torch.unique(a, return_inverse=True, return_counts=True), torch.zeros(0, 3, dtype=dtype))
    assert_matches_cpu(lambda a: torch.unique(a, return_inverse=True, return_counts=True), torch.ones((), dtype=dtype))
    if dtype == torch.float32:  # every NaN is its own value
        assert_matches_cpu(lambda a: torch.unique(a, return_inverse=True, return_counts=True),
                           torch.tensor([1.0, float("nan"), 1.0, float("nan"), -0.5]))
    no_fallbacks()


def test_boolean_mask_indexing():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 5, generator=gen)
    mask = x > 0
    assert_matches_cpu(lambda a, m: a[m], x, mask)
    assert_matches_cpu(lambda a, m: a[m], x, torch.zeros(4, 5, dtype=torch.bool))
    assert_matches_cpu(lambda a, m: a[:, m], x, torch.tensor([True, False, True, True, False]))
    assert_matches_cpu(lambda a, m: a[m, 1:], x, torch.tensor([False, True, True, False]))

    def assign(a, m):
        a = a.clone()
        a[m] = -1.0
        return a
    assert_matches_cpu(assign, x, mask)
    no_fallbacks()
    with pytest.raises(IndexError):
        x.to("tpu")[torch.tensor([True, False], device="tpu")]


# ---- a tiny transformers MoE model ----

def train_moe(device, steps=3):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, attention_dropout=0.0, output_router_logits=True)
    torch.manual_seed(0)
    model = transformers.Qwen2MoeForCausalLM(config).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 12), generator=gen).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def test_tiny_moe_model_trains_like_cpu():
    cpu_losses, cpu_model = train_moe("cpu")
    torch_pjrt.reset_metrics()
    tpu_losses, tpu_model = train_moe("tpu")
    fallbacks = torch_pjrt.metrics()["cpu_fallbacks"]
    print("MoE training CPU fallbacks:", fallbacks)
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(cpu_model.state_dict().items(), tpu_model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-3, msg=name)
    assert not fallbacks, fallbacks
