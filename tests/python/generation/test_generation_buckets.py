"""Growing sequences reuse programs: flat cats write capacity buckets (docs/architecture.md, "Generation").

A `torch.cat` whose result is its pieces' flat concatenation (only size-1 dims before the cat dim, contiguous pieces
of one dtype: transformers' `input_ids`/`position_ids` growing one token per step) is keyed by its pieces' storage
extents and its result's power-of-two capacity; positions are runtime operands. Here:

- flat cats give the CPU's values in every mode (offsets, shared storages, dtypes, writes into the result, bucket
  crossings, resizing), and an append loop inside one bucket compiles nothing;
- greedy `generate()` of tiny GPT-2 and Llama configs gives the CPU's tokens (and logits), and with the static KV
  cache compiles nothing per token after warm-up, in fused and strict mode (a new prompt length compiles its prefill
  and first steps, then nothing), nor in a second generate() with the same lengths.
- a batch of sequences (rows before the cat dim: `input_ids` of a batch) is a row cat of runtime lengths, and its
  strided views (`ids[:, -1:]`) take runtime strides: batched static-cache decoding compiles nothing per token either;
- elementwise ops over growing tensors (a mask's `.bool()`, `masked_fill_`) keep capacity storages, and
  `F.pad` of one to a fixed width reads it padded: left-padded batches decode with the static cache compiling nothing
  per token; in-place ops on part of a growing tensor stay exact;
- the dynamic KV cache compiles nothing per token inside a capacity bucket (attention over a padded cache), for one
  prompt or a batch (whose new keys are strided pieces of the cache's row cat);
- runtime-length ops (the 4-d mask transformers builds per token for a left-padded batch: arange, broadcast
  comparisons, an index of the 2-d mask, sums) give the CPU's values and errors and compile nothing inside a bucket,
  so left-padded batches decode with the dynamic cache compiling nothing per token too.
"""
import warnings

import pytest
import torch

import torch_pjrt
from conftest import tiny_model

pytestmark = pytest.mark.modes_inside  # runs its modes itself

MODES = ["fused", "strict", "debug", "lazy"]


def compiles():
    return torch_pjrt.metrics()["compiles"]


def run_both(fn, *args):
    """fn on CPU tensors and on tpu copies; the tpu results read back."""
    expected = fn(*args)
    actual = fn(*[a.to("tpu") for a in args])
    return expected, [a.cpu() for a in actual]


def assert_exact_in(mode, fn, *args):
    """fn's results in `mode` on tpu equal the CPU's exactly: values, dtypes, shapes."""
    with torch_pjrt.mode(mode):
        expected, actual = run_both(fn, *args)
    for e, a in zip(expected, actual):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=0, atol=0)


# ---- flat cats -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_append_loop_matches_cpu_across_buckets(mode):
    # 3 + 140 columns: crosses the 64 and 128 capacities; the last column is read at a runtime offset.
    start = torch.randint(0, 100, (1, 3))
    steps = torch.randint(0, 100, (140,))

    def grow(x, s):
        lasts = []
        for i in range(s.shape[0]):
            x = torch.cat([x, s[i:i + 1][None] + x[:, -1:]], dim=-1)
            lasts.append(x[:, -1:] * 2)
        return [x, torch.cat(lasts, dim=0)]

    assert_exact_in(mode, grow, start, steps)


@pytest.mark.parametrize("mode", MODES)
def test_flat_cat_pieces_at_offsets_shared_and_dtypes(mode):
    def pieces(big, flags, half):
        a = torch.cat([big[:, 2:5], big[:, 7:9], big[:, 1:2]], dim=1)  # every piece at a nonzero offset
        b = torch.cat([big[0], big[0], big[0, 3:]])                    # one storage three times, 1-D
        c = torch.cat([flags[1:4], flags[:2]])                          # bool
        d = torch.cat([half, half[2:] * 2], dim=0)                      # float16
        e = torch.cat([a, b[None, 4:]], dim=1)                          # a capacity storage as a piece
        return [a, b, c, d, e]

    big = torch.arange(10, dtype=torch.float32).reshape(1, 10) * 1.5
    flags = torch.tensor([True, False, True, True, False])
    half = torch.randn(5, dtype=torch.float16)
    assert_exact_in(mode, pieces, big, flags, half)


@pytest.mark.parametrize("mode", MODES)
def test_flat_cat_result_written_viewed_and_resized(mode):
    def use(x, y):
        z = torch.cat([x, y], dim=-1)  # [1, 1, 7]
        z[..., 1] = 5
        z.add_(1)
        w = torch.cat([z, z], dim=-1).view(2, 7)
        w[1, 2:4] = -1
        r = torch.cat([x.flatten(), y.flatten()])
        r.resize_(200)  # grows past its capacity: the first 7 keep their values
        return [z, w, w.t().contiguous(), w.sum(1), r[:7].clone()]

    x, y = torch.randn(1, 1, 3), torch.randn(1, 1, 4)
    with torch_pjrt.mode(mode):
        expected, actual = run_both(use, x, y)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)


def test_flat_cat_storage_keeps_logical_size():
    # The capacity is the device buffer's; PyTorch sees the CPU's storage size and strides.
    x = torch.arange(5).reshape(1, 5)
    z = torch.cat([x.to("tpu"), x.to("tpu")], dim=1)
    assert z.untyped_storage().nbytes() == torch.cat([x, x], dim=1).untyped_storage().nbytes()
    assert z.stride() == (10, 1)
    torch.testing.assert_close(z.untyped_storage().cpu(), torch.cat([x, x], dim=1).untyped_storage())
    torch.testing.assert_close(z[:, :3].cpu(), x[:, :3])  # a prefix view reads only its elements
    torch.testing.assert_close(z.view(2, 5)[1].cpu(), x[0])


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_append_inside_a_bucket_compiles_nothing(mode):
    with torch_pjrt.mode(mode):
        x = torch.zeros(1, 70, dtype=torch.long, device="tpu")  # capacity 128
        step = torch.ones(1, 1, dtype=torch.long, device="tpu")
        for i in range(4):  # warm-up: offset 0 vs runtime offsets, first capacity storage
            x = torch.cat([x, x[:, -1:] + step], dim=-1)
            x[:, -1:].cpu()
        before = compiles()
        for i in range(40):
            x = torch.cat([x, x[:, -1:] + step], dim=-1)
            last = x[:, -1:].cpu()
        assert compiles() == before, torch_pjrt.explain()
    assert last.item() == 44 and x.shape == (1, 114)


# ---- row cats: a batch of sequences -------------------------------------------------------------------------
# A flat cat with rows (dims before the cat dim that are not 1) of a small integer or bool tensor: a batch's
# input_ids / attention_mask. Its strided views (`ids[:, -1:]`) read and write at runtime strides.


@pytest.mark.parametrize("mode", MODES)
def test_row_cats_match_cpu_across_buckets(mode):
    start = torch.randint(0, 100, (3, 4), dtype=torch.int32)
    steps = torch.randint(0, 100, (3, 70), dtype=torch.int32)  # 3 x 74 columns: crosses the 64 and 128 capacities

    def grow(x, s):
        mask = torch.ones_like(x, dtype=torch.bool)
        lasts = []
        for i in range(s.shape[1]):
            x = torch.cat([x, s[:, i:i + 1] + x[:, -1:]], dim=-1)  # the piece read at runtime strides
            mask = torch.cat([mask, (x[:, -1:] % 3) != 0], dim=1)
            lasts.append(x[:, -1:] * 2)
            if i % 17 == 0:
                x[:, -2] = -i           # written through a strided view of the capacity storage
                x[1:, -1:].add_(1)      # in place, at an offset and a runtime stride
        return [x, mask, torch.cat(lasts, dim=1), x[:, ::3], x.t().contiguous(), x[:, 1:-1].sum(1)]

    assert_exact_in(mode, grow, start, steps)


@pytest.mark.parametrize("mode", MODES)
def test_row_cats_of_several_leading_dims_pieces_at_offsets_and_floats(mode):
    def pieces(a, b, f):
        x = torch.cat([a[:, :, 1:3], b, a[:, :, :1]], dim=2)          # rows over two dims, pieces at offsets
        y = torch.cat([x, x[:, :, -2:].contiguous() * 3], dim=2)       # a capacity storage as a piece
        z = torch.cat([f, f * 2], dim=-1)                              # float: XLA's concatenate, exact size
        return [x, y, y[1, :, ::2], z]

    a = torch.randint(-50, 50, (2, 3, 4))
    b = torch.randint(-50, 50, (2, 3, 5))
    f = torch.randn(4, 6)
    assert_exact_in(mode, pieces, a, b, f)


@pytest.mark.parametrize("mode", MODES)
def test_cache_grown_by_strided_pieces_matches_cpu(mode):
    # A batch's KV cache [batch, heads, length, width] grows by a transposed view per step (the new token's key):
    # a row cat whose later piece is read through its strides.
    def grow(cache, steps):
        outs = []
        for i in range(steps.shape[1]):
            qkv = steps[:, i:i + 1] * (i + 1)                           # [2, 1, 24]: a fused projection's output
            new = qkv[..., 12:].view(2, 1, 3, 4).transpose(1, 2)        # [2, 3, 1, 4], strides (24, 4, 12, 1)
            cache = torch.cat([cache, new], dim=2)
            outs += [cache[:, :, -2:].sum(2), cache.sum((2, 3))]  # integer-valued floats: exact sums
        return outs + [cache]

    cache = torch.randint(-9, 9, (2, 3, 5, 4)).float().transpose(1, 2).contiguous().transpose(1, 2)
    cache = torch.cat([cache, cache[:, :, :1]], dim=2)  # the first cat: a transposed piece
    assert_exact_in(mode, grow, cache, torch.randint(-9, 9, (2, 40, 24)).float())


@pytest.mark.parametrize("mode", MODES)
def test_strided_views_of_a_growing_storage_keep_cpu_layouts(mode):
    # Views of a capacity storage read at runtime strides; their key holds the stride order, not the values.
    # Results' strides (clone preserves a dense layout, elementwise ops follow the inputs' order) match the CPU's.
    def grow(x):
        outs = []
        for i in range(12):
            x = torch.cat([x, x[:, -2:] + i], dim=-1)     # two columns a step: pairs stay whole
            t = x.view(2, -1, 2)[:, -3:]                  # [2, 3, 2]: strides (L, 2, 1)
            for v in (x[:, -1:], x[:, -4:], x[:, ::2], t, t.transpose(1, 2), t[:, :, :1].expand(2, 3, 2)):
                outs += [v.clone(), v + 1, v * v, torch.empty_like(v).copy_(v)]
        return outs

    def check(device):
        return grow(torch.arange(12, device=device).view(2, 6))

    expected = check("cpu")
    with torch_pjrt.mode(mode):
        got = check("tpu")
        strides = [g.stride() for g in got]
        got = [g.cpu() for g in got]
    for e, g, s in zip(expected, got, strides):
        assert torch.equal(g, e) and s == e.stride(), (s, e.stride())


@pytest.mark.parametrize("mode", MODES)
def test_a_capacity_view_and_a_plain_view_of_equal_metadata(mode):
    # Same sizes, strides, offset and storage extent: the capacity storage's view reads at runtime strides,
    # the plain one at static strides, so their ops must not share a plan.
    def views(device):
        ids = torch.cat([torch.arange(78, device=device).view(2, 39), torch.full((2, 1), 7, device=device)], 1)
        base = torch.arange(128, device=device) * 10  # 128 elements: the capacity of ids
        return ids[:, -1:], base[:80].view(2, 40)[:, -1:]

    a, b = views("cpu")
    expected = [a + 5, (b + 5) * 2, b + 5, (a + 5) * 2]
    with torch_pjrt.mode(mode):
        a, b = views("tpu")
        assert a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
        got = [(a + 5).cpu(), ((b + 5) * 2).cpu(), (b + 5).cpu(), ((a + 5) * 2).cpu()]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_batched_append_inside_a_bucket_compiles_nothing(mode):
    with torch_pjrt.mode(mode):
        x = torch.zeros(3, 40, dtype=torch.long, device="tpu")  # 120 elements: capacity 128 until 42 columns
        x = torch.cat([x, x[:, -1:]], dim=-1)
        x = torch.cat([x, x[:, -1:] + 1], dim=-1)
        x[:, -1:].cpu()
        x = torch.zeros(3, 43, dtype=torch.long, device="tpu")  # capacity 256: up to 85 columns
        for i in range(4):  # warm-up: the first capacity storage, then runtime strides
            x = torch.cat([x, x[:, -1:] + 1], dim=-1)
            x[:, -1:].cpu()
        before = compiles()
        for i in range(36):
            x = torch.cat([x, x[:, -1:] + 1], dim=-1)
            last = x[:, -1:].cpu()
        assert compiles() == before, torch_pjrt.explain()
    assert last.flatten().tolist() == [40] * 3 and x.shape == (3, 83)


def grow_and_use(m0, steps, width):
    """A growing int mask and what generation computes from it each step (CPU reference in the tests)."""
    m, outs = m0, []
    for s in range(steps):
        m = torch.cat([m, torch.full((m.shape[0], 1), s % 2, dtype=m.dtype, device=m.device)], -1)
        b = m.bool()
        p = m * 3 - 1
        p.masked_fill_(m == 0, 7)
        padded = torch.nn.functional.pad(b, (0, width - m.shape[1]), value=True)
        outs += [b, p, padded]
    return outs


@pytest.mark.parametrize("mode", MODES)
def test_elementwise_ops_on_growing_tensors_match_cpu(mode):
    m0 = torch.ones(2, 5, dtype=torch.long)
    m0[1, :2] = 0

    def fn(m0):
        outs = grow_and_use(m0, 70, 80)  # crosses capacities 64 and 128 (2 rows)
        m = outs[-2]
        m[:1].add_(5)  # in place on part of a growing tensor: only row 0 changes
        part = m.clone()
        m.add_(1)  # in place on the whole of it
        return outs + [part, m]

    assert_exact_in(mode, fn, m0)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_elementwise_ops_on_growing_tensors_inside_a_bucket_compile_nothing(mode):
    m0 = torch.ones(2, 34, dtype=torch.long)  # capacity 128 up to 64 columns
    with torch_pjrt.mode(mode):
        m = m0.to("tpu")
        for _ in range(2):  # warm-up: the first capacity storages
            m = torch.cat([m, m[:, -1:] * 1], -1)
            [t.cpu() for t in grow_and_use(m, 1, 64)]
        before = compiles()
        for _ in range(20):
            m = torch.cat([m, m[:, -1:] * 1], -1)
            last = [t.cpu() for t in grow_and_use(m, 1, 64)]
        assert compiles() == before, torch_pjrt.explain()
    expected = grow_and_use(torch.ones(2, 56, dtype=torch.long), 1, 64)
    for e, g in zip(expected, last):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_capacity_elementwise_keys_keep_rank_and_emptiness(mode):
    # A capacity op's key holds no sizes: a 0-d view, an empty view and the whole tensor must still get their own
    # plans (broadcasting, type promotion, an empty result), whichever ran first.
    def grown(dtype, device):  # a row cat on the device: a capacity storage there
        a = torch.arange(1, 7, dtype=dtype, device=device).reshape(2, 3)
        return torch.cat([a, torch.full((2, 1), 7, dtype=dtype, device=device)], 1)

    def fn(a32, b64):
        a, b = grown(torch.int32, a32.device), grown(torch.int64, a32.device) * 1000000007
        return [a + a[0, 0], a + a, a + b[0, 0], a + b, (a[:, :0] == 1), (a == 1), a[:, :0] + 1, a + 1]

    x = torch.zeros(1)
    for order in (fn, lambda a32, b64: fn(a32, b64)[::-1]):
        assert_exact_in(mode, order, x, x)


# ---- runtime-length ops: the mask transformers builds per token -------------------------------------------------


def mask_chain(mask, per_length_op=True):
    """What transformers' sdpa_mask computes from a left-padded batch's 2-d mask at a decode step, and more ops over
    the same growing last dim (reductions, aranges with steps, an index whose result holds the length twice)."""
    dev, n, batch = mask.device, mask.shape[-1], mask.shape[0]
    padding = mask.bool()
    all_ones = padding.sum() == padding.numel()
    kv = torch.arange(n, device=dev) + 0
    q = torch.arange(1, device=dev) + (n - 1)
    rows = torch.arange(batch, device=dev)
    allowed = q.new_ones((), dtype=torch.bool) & (kv[None, None, None, :] <= q[None, None, None, :])
    allowed = allowed & padding[rows[:, None, None, None], kv[None, None, None, :]]
    allowed = allowed.expand(batch, -1, 1, n)
    bias = torch.where(allowed, torch.tensor(0.0, device=dev), torch.tensor(float("-inf"), device=dev))
    outs = [all_ones, allowed, bias, bias.sum(-1), padding.any(-1), padding.all(-1), (mask + 1).prod(-1),
            padding[:, -2:].sum(-1), padding.sum(0), kv, torch.arange(2, n, 3, device=dev),
            torch.arange(n, 0, -2, device=dev, dtype=torch.int32)]
    # Written results: in place with a broadcast operand (the whole capacity storage is rewritten), and out=.
    grown = mask * 2
    grown.add_(rows[:, None] * 1000)  # (a Scalar equal to a runtime length shares its operand: another graph)
    summed = torch.add(kv, grown, alpha=3, out=torch.empty(0, dtype=torch.long, device=dev))
    reduced = torch.sum(grown, -1, out=torch.empty(0, dtype=torch.long, device=dev))  # an out= without the length
    stepped = torch.arange(3, n + 7, 4, out=torch.empty(0, dtype=torch.int32, device=dev))
    outs += [grown, summed, grown.float() * 0.5, reduced, stepped, stepped * 2]
    if per_length_op:  # results holding the length in two dims: keyed, or planned (CachedOp::exact_length), per length
        outs += [kv[:, None] - kv[None, :], kv[None, :][kv[None, :] * 0]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # out= resized from a larger size: deprecated, still done
            outs.append(torch.arange(n, out=torch.empty(100, dtype=torch.long, device=dev)))
    return outs


def grow_mask(steps, start=5):
    m = torch.ones(2, start, dtype=torch.long)
    m[1, :2] = 0
    for s in range(steps):
        yield m
        m = torch.cat([m, torch.full((2, 1), 1 - s % 3 // 2, dtype=m.dtype, device=m.device)], -1)


@pytest.mark.parametrize("mode", MODES)
def test_runtime_length_ops_match_cpu_across_buckets(mode):
    # 5 to 69 columns: the mask's capacity crosses 64 and 128 (2 rows), aranges cross 64.
    expected = [mask_chain(m) for m in grow_mask(65)]
    with torch_pjrt.mode(mode):
        m = None
        for step, want in enumerate(expected):
            m = torch.ones(2, 5, dtype=torch.long) if m is None else m
            m = grown = m.to("tpu") if step == 0 else torch.cat(
                [m, torch.full((2, 1), 1 - (step - 1) % 3 // 2, dtype=m.dtype, device="tpu")], -1)
            if step == 0:
                grown[1, :2] = 0
            for e, g in zip(want, mask_chain(grown)):
                assert g.dtype == e.dtype and g.shape == e.shape, (step, g.shape, e.shape)
                torch.testing.assert_close(g.cpu(), e, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_runtime_length_ops_inside_a_bucket_compile_nothing(mode):
    with torch_pjrt.mode(mode):
        masks = [m.to("tpu") for m in grow_mask(1, 8)]
        m = masks[0]
        for _ in range(3):  # warm-up: the first row cat, then a capacity storage extended
            m = torch.cat([m, m[:, -1:] * 1], -1)
            [t.cpu() for t in mask_chain(m, False)]
        before = compiles()
        for _ in range(18):  # 11 to 29 columns: capacity 64 for the mask (2 rows) and the aranges
            m = torch.cat([m, m[:, -1:] * 1], -1)
            last = [t.cpu() for t in mask_chain(m, False)]
        assert compiles() == before, torch_pjrt.explain()
    for e, g in zip(mask_chain(m.cpu(), False), last):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_runtime_length_index_out_of_range_raises_as_on_cpu(mode):
    # The bound of a runtime-length dim is its runtime size, not the padded bound, and the message shows it.
    def bad(mask):
        kv = torch.arange(mask.shape[-1], device=mask.device)
        rows = torch.arange(2, device=mask.device)
        return mask.bool()[rows[:, None], kv[None, :] + 1]

    m = torch.ones(2, 12, dtype=torch.long)
    with pytest.raises(IndexError) as cpu:
        bad(m)
    with torch_pjrt.mode(mode):
        grown = torch.cat([m[:, :6].to("tpu"), m[:, 6:].to("tpu")], -1)
        with pytest.raises(IndexError) as tpu:
            bad(grown).cpu()
        ok = grown.bool()[torch.arange(2, device="tpu")[:, None], torch.arange(12, device="tpu")[None, :] - 12]
        torch.testing.assert_close(ok.cpu(), m.bool(), rtol=0, atol=0)  # negative indices count from the runtime end
    assert str(cpu.value) in str(tpu.value), (str(cpu.value), str(tpu.value))


def test_pad_value_out_of_range_raises_as_on_cpu():
    x = torch.ones(2, dtype=torch.half)
    with pytest.raises(RuntimeError) as cpu:
        torch.nn.functional.pad(x, (1, 1), value=1e5)
    with pytest.raises(RuntimeError) as dev:
        torch.nn.functional.pad(x.to("tpu"), (1, 1), value=1e5).cpu()
    assert "overflow" in str(cpu.value) and "overflow" in str(dev.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_constant_pad_nd_matches_cpu(dtype, mode):
    x = (torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    value = True if dtype == torch.bool else 2
    pads = [(0, 3), (2, 1), (1, -2), (-1, -1, 2, 0), (1, 2, 3, 4, 0, 1), (0, 0), (-2, 4, 0, -1)]

    def fn(x):
        return [torch.nn.functional.pad(x, p, value=value) for p in pads] + [torch.nn.functional.pad(x, (1, 1))]

    assert_exact_in(mode, fn, x)


# ---- generate() ----------------------------------------------------------------------------------------------


class CompileCounter:
    """A transformers StoppingCriteria that records the compile count after each generated token."""

    def __init__(self):
        self.counts = []

    def __call__(self, input_ids, scores, **kwargs):
        self.counts.append(compiles())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, ids, tokens, cache, counter=None, mask=None):
    import transformers
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    if cache == "static":
        kw.update(cache_implementation="static", disable_compile=True)
    if counter is not None:
        kw["stopping_criteria"] = transformers.StoppingCriteriaList([counter])
    if mask is not None:
        kw["attention_mask"] = mask
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, **kw)
    return out.sequences.cpu(), torch.stack([l.cpu() for l in out.logits])


N = 4


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_static_cache_generation_compiles_nothing_per_token(kind, mode):
    pytest.importorskip("transformers")
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (1, length), generator=g) for length in (6, 6, 20)]
    tokens = [3 * N] * 3  # the static cache's size follows prompt length + max_new_tokens
    expected = [generate(model, p, n, "static") for p, n in zip(prompts, tokens)]
    model.to("tpu")
    with torch_pjrt.mode(mode):
        got = [generate(model, prompts[0].to("tpu"), tokens[0], "static")]  # warm-up
        before = compiles()
        got.append(generate(model, prompts[1].to("tpu"), tokens[1], "static"))  # another prompt of that length
        same_length = compiles() - before
        counter = CompileCounter()  # a new prompt length (lengths 20..32, none seen): a new prefill, then nothing
        got.append(generate(model, prompts[2].to("tpu"), tokens[2], "static", counter))
    for (e_ids, e_logits), (ids, logits) in zip(expected, got):
        torch.testing.assert_close(ids, e_ids, rtol=0, atol=0)
        torch.testing.assert_close(logits, e_logits, rtol=1e-4, atol=1e-4)
    assert same_length == 0, torch_pjrt.explain()
    per_token = counter.counts[-1] - counter.counts[2]
    assert per_token == 0, (counter.counts, torch_pjrt.explain())


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("left_padded", [False, True])
def test_batched_static_cache_generation_compiles_nothing_per_token(left_padded, kind, mode):
    # A batch of 2 prompts: input_ids and attention_mask grow by a column per token (row cats). Left-padded (prompts
    # of different lengths), the mask has zeros, and transformers pads its `.bool()` to the cache's length with F.pad
    # each step.
    pytest.importorskip("transformers")
    model = tiny_model(kind)
    prompts = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(8 if left_padded else 7))
    mask = None
    if left_padded:
        mask = torch.ones_like(prompts)
        mask[1, :3] = 0
        prompts[1, :3] = 0
    expected = generate(model, prompts, 3 * N, "static", mask=mask)
    model.to("tpu")
    with torch_pjrt.mode(mode):
        counter = CompileCounter()
        got = generate(model, prompts.to("tpu"), 3 * N, "static", counter, None if mask is None else mask.to("tpu"))
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)
    # Left-padded, the last token's mask fills the cache: that step is another graph (one op fewer), compiled once.
    per_token = counter.counts[-2 if left_padded else -1] - counter.counts[3]
    assert per_token == 0, (counter.counts, torch_pjrt.explain())


# Dynamic cache: from its second decode step the cache is a capacity storage (a float row cat extending a cat's
# result) and attention reads it padded to that capacity, the true length a runtime operand (lowerings/attention.cpp),
# so tokens inside a capacity bucket compile nothing. Before: fused 1 and strict 8-9 programs per token.
@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("batch", [1, 2, "2p"])
def test_dynamic_cache_generation_compiles_nothing_inside_a_bucket(batch, kind, mode):
    # A batch of 2 grows each layer's cache by the new token's transposed key and value (strided row-cat pieces)
    # and reads input_ids[:, -1:] at runtime strides. Left-padded ("2p"), transformers builds a 4-d mask from the
    # growing 2-d one each token: runtime-length ops.
    pytest.importorskip("transformers")
    model = tiny_model(kind)
    g = torch.Generator().manual_seed(6)
    rows = 2 if batch == "2p" else batch
    prompts = [torch.randint(3, 128, (rows, length), generator=g) for length in (6, 6, 10)]
    masks = [torch.ones_like(p) for p in prompts]
    if batch == "2p":
        for p, m in zip(prompts, masks):
            p[1, :3], m[1, :3] = 0, 0
    tokens = [3 * N, 3 * N, 6]
    expected = [generate(model, p, n, "dynamic", mask=m) for p, n, m in zip(prompts, tokens, masks)]
    model.to("tpu")
    with torch_pjrt.mode(mode):
        run = lambda k, counter=None: generate(model, prompts[k].to("tpu"), tokens[k], "dynamic", counter,
                                               masks[k].to("tpu"))
        got = [run(0)]  # warm-up: cache lengths 6 to 17
        before = compiles()
        got.append(run(1))  # the same lengths again
        same_lengths = compiles() - before
        counter = CompileCounter()  # a new prompt length: cache lengths 10 to 15, inside one capacity bucket
        got.append(run(2, counter))
    for (e_ids, e_logits), (ids, logits) in zip(expected, got):
        torch.testing.assert_close(ids, e_ids, rtol=0, atol=0)
        torch.testing.assert_close(logits, e_logits, rtol=1e-4, atol=1e-4)
    assert same_lengths == 0, torch_pjrt.explain()
    # The new length's prefill, first step (the prompt's key is a transposed view: an exact cat) and second
    # step (the first row cat) compile; every later token compiles nothing.
    assert counter.counts[-1] - counter.counts[2] == 0, (counter.counts, torch_pjrt.explain())
