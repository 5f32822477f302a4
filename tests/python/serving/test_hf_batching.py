"""transformers' continuous batching (`generate_batch`) on tpu: HF's greedy tokens, and a paged cache sized from
the device's memory (torch.tpu.mem_get_info), not from the host's total RAM as for an unknown device."""
import pytest
import torch

import torch_pjrt

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as cb_cache  # noqa: E402

PROMPTS = [[1, 5, 9, 20], [1, 7], [1, 3, 3, 3, 3, 3, 8]]


def tiny_llama():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def hf_greedy(model, new_tokens):
    return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]


def batch_greedy(model, new_tokens, cb_config):
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = model.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=cb_config)
    return [results[k].generated_tokens for k in sorted(results, key=lambda k: int(k.rsplit("_", 1)[-1]))]


def test_cache_sized_from_device_memory_and_tokens_equal_hf(monkeypatch):
    model = tiny_llama()
    want = hf_greedy(model, 6)
    sized = []
    original = cb_cache.PagedAttentionMemoryHandler.get_available_memory

    def spy(self):
        sized.append(original(self))
        return sized[-1]

    monkeypatch.setattr(cb_cache.PagedAttentionMemoryHandler, "get_available_memory", spy)
    # The device reports 3 GiB free of 4 (a number no host here has as its RAM); no num_blocks: the cache
    # takes `percent` of the free device memory, as transformers does with torch.cuda.mem_get_info.
    free, total = 3 << 30, 4 << 30
    monkeypatch.setattr(torch.tpu, "mem_get_info", lambda device=None: (free, total))
    percent = 0.02
    got = batch_greedy(model.to("tpu"), 6, ContinuousBatchingConfig(max_memory_percent=percent, max_batch_tokens=64))
    assert got == want
    assert sized and sized[0] == int(free * percent), (sized, free)
    assert torch_pjrt.metrics()["cpu_fallbacks"] == {}


def test_a_cpu_model_keeps_transformers_own_sizing(monkeypatch):
    calls = []
    monkeypatch.setattr("torch_pjrt.serving.hf_batching.tpu_memory_breakdown", lambda d: calls.append(d))
    model = tiny_llama()
    want = hf_greedy(model, 3)
    assert batch_greedy(model, 3, ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32)) == want
    assert calls == []
