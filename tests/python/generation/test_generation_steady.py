"""Steady-state greedy generation with the static KV cache (no torch.compile): how much compiles per token.

After a warm-up generate() of N tokens, a generate() of 2N tokens with another prompt of the same length gives
the CPU's tokens and compiles at most PER_TOKEN programs per generated token plus a constant (the prefill and
first decode step for the new cache length). The bound is what the design reaches today (see the "Generation"
paragraph of docs/architecture.md): transformers grows
`input_ids` by one column per token with `torch.cat` (a new shape), and the decode step's graph takes that
growing storage as a parameter, so the step's graphs still differ per token. The bound is a regression guard:
it fails if a change makes the steady state compile more.

Also: views with size-1 dims and nonzero offsets read and write as on the CPU in every mode.
"""
import warnings

import pytest
import torch

import torch_pjrt
from conftest import tiny_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.modes_inside  # runs its modes itself

N = 4
PROMPT = 6
# Programs per generated token in the steady state, and the constant for a new cache length (prefill,
# first decode step, cache set-up), per mode. Fused: the decode step's forward graph and its sampling graph
# (the outermost module call cuts the graph); strict: the ops that read the growing `input_ids`/`position_ids`.
# Measured, each in a fresh process (2N = 8 tokens): GPT-2 fused 13, strict 33; Llama fused 13, strict 32.
PER_TOKEN = {"fused": 2, "strict": 4}
CONSTANT = {"fused": 8, "strict": 40}


def generate(model, ids, tokens):
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
              cache_implementation="static", disable_compile=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kw)


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_steady_generation_compiles_bounded(mode, kind):
    model = tiny_model(kind)
    prompts = torch.randint(3, 128, (2, 1, PROMPT), generator=torch.Generator().manual_seed(2))
    expected = [generate(model, prompts[0], N), generate(model, prompts[1], 2 * N)]
    model.to("tpu")
    with torch_pjrt.mode(mode):
        warm = generate(model, prompts[0].to("tpu"), N).cpu()
        compiles = torch_pjrt.metrics()["compiles"]
        out = generate(model, prompts[1].to("tpu"), 2 * N).cpu()
        new = torch_pjrt.metrics()["compiles"] - compiles
    torch.testing.assert_close(warm, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(out, expected[1], rtol=0, atol=0)
    assert new <= CONSTANT[mode] + PER_TOKEN[mode] * 2 * N, (new, torch_pjrt.explain())


@pytest.mark.parametrize("mode", ["fused", "strict", "debug", "lazy"])
def test_contiguous_views_with_size_one_dims_read_right(mode):
    # Canonical strides must not change what a view reads: size-1 dims anywhere, nonzero offsets,
    # writes through such views, and a non-contiguous view next to them.
    base = torch.randn(4, 1, 6, generator=torch.Generator().manual_seed(3))
    with torch_pjrt.mode(mode):
        t = base.to("tpu")
        views = [t[2:3], t[1:2, :, 3:4], t[:, :, 5:6], t[3, :, 2:], t.transpose(0, 2)[1:2]]
        results = [(v * 2 + v.sum()).cpu() for v in views]
        w = t.clone()
        w[1:2, :, 3:4].add_(5)
        w[:, :, 0:1] = -1
        written = w.cpu()
    cpu_views = [base[2:3], base[1:2, :, 3:4], base[:, :, 5:6], base[3, :, 2:], base.transpose(0, 2)[1:2]]
    for got, v in zip(results, cpu_views):
        torch.testing.assert_close(got, v * 2 + v.sum())
    expected = base.clone()
    expected[1:2, :, 3:4].add_(5)
    expected[:, :, 0:1] = -1
    torch.testing.assert_close(written, expected)


def test_explain_names_a_changed_storage_size():
    # The same shapes read from a larger storage (a growing `input_ids`): explain() says what differs.
    with torch_pjrt.mode("fused"):
        for width in (37, 38):
            ids = torch.arange(width).reshape(1, width).to("tpu")
            (ids[:, -1:] * 3).cpu()
    assert any("storage of 304 bytes, before: contiguous, runtime offset, storage of 296 bytes" in r
               for r in torch_pjrt.explain().recompiles), torch_pjrt.explain()
