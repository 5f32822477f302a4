"""Greedy generation with tiny random-init transformers models gives the CPU's tokens.

Both KV caches: the default dynamic cache (grows by concatenation) and the
static cache (`index_copy_` into a fixed buffer at `cache_position`, lowered:
no CPU fallback). A second generate() call with the same lengths finds every
program compiled. Known limit: within one call each new token still compiles
(transformers grows `input_ids`/`attention_mask` by one per token, a new shape;
see docs/architecture.md).
"""
import warnings

import pytest
import torch

import torch_pjrt
from conftest import tiny_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

NEW_TOKENS = 8


def generate(model, ids, cache):
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    if cache == "static":
        # transformers would torch.compile a static-cache decode step on a "tpu" device (with the backend
        # named "tpu": ours); this file tests the eager path, test_compile_default.py the compiled one.
        kw.update(cache_implementation="static", disable_compile=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, **kw)


def index_copy_counts():
    """(CPU fallbacks, lowered runs) of index_copy so far."""
    m = torch_pjrt.metrics()
    return tuple(sum(n for op, n in m[k].items() if "index_copy" in op) for k in ("cpu_fallbacks", "lowered_ops"))


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("kind,cache", [("gpt2", "dynamic"), ("llama", "dynamic"), ("gpt2", "static"),
                                        ("llama", "static")])
def test_generate_matches_cpu(mode, kind, cache):
    model = tiny_model(kind)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = generate(model, ids, cache)
    assert expected.shape == (2, 5 + NEW_TOKENS)
    with torch_pjrt.mode(mode):
        model.to("tpu")
        fallbacks, lowered = index_copy_counts()
        torch.testing.assert_close(generate(model, ids.to("tpu"), cache).cpu(), expected, rtol=0, atol=0)
        assert index_copy_counts()[0] == fallbacks
        if cache == "static":  # keys and values of every layer, every step, written by the lowered index_copy_
            assert index_copy_counts()[1] - lowered >= 2 * 2 * NEW_TOKENS
        # Warm: the same lengths again compile nothing.
        compiles = torch_pjrt.metrics()["compiles"]
        torch.testing.assert_close(generate(model, ids.to("tpu"), cache).cpu(), expected, rtol=0, atol=0)
        assert torch_pjrt.metrics()["compiles"] == compiles
