"""vLLM's offline LLM.generate on tpu through torch_pjrt's platform plugin (torch_pjrt.vllm, docs/serving.md):
greedy tokens of a tiny random-init Llama equal transformers' generate() on the CPU, with no CPU fallback in the
engine's process, and nothing compiles after the engine's warm-up of its token and request buckets: one engine
runs batches of different sizes, a lone prompt after a batch, chunked prefills (max_num_batched_tokens=32), the
same prompts again (prefix-cache hits) and a batch of five.

The engine runs in a child process (this file run as a script), as a user's script would: vLLM spawns its
engine core and sets process-wide state (logging, torch settings) that the test process must not keep.
vLLM finds the platform through the `vllm.platform_plugins` entry point; where torch_pjrt is not installed
(tests run from the source tree), the child gets a stand-in distribution's metadata that declares it."""
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PROMPTS = [[1, 5, 9, 33, 100], [1, 7, 200, 3, 44, 45, 46, 47, 80, 12, 13, 90, 91, 92], [1, 250]]
NEW_TOKENS = 12
MAX_NUM_BATCHED_TOKENS = 32  # prompts longer than this prefill in chunks over several steps


def _prompt(length, seed):
    return [1] + [(seed * 37 + i * 11) % 253 + 3 for i in range(length - 1)]


CHUNKED = [_prompt(41, 1), _prompt(71, 2), _prompt(4, 3)]
# One generate() each, in order: batched prompts, a lone prompt after the batch, chunked prefills, the same again
# (their first blocks now prefix-cache hits), five requests (the request bucket of 8).
ROUNDS = [PROMPTS, [_prompt(9, 4)], CHUNKED, CHUNKED,
          [_prompt(3, 5), _prompt(20, 6), _prompt(7, 7), _prompt(11, 8), _prompt(30, 9)]]

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (docs/serving.md says how)")


def tiny_llama(path):
    """A random-init Llama: head size 32, 4 query heads over 2 key-value heads (GQA), 2 layers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def entry_point_env(tmp_path):
    """The child's environment: torch_pjrt importable, and its vllm.platform_plugins entry point visible."""
    paths = [os.path.join(ROOT, "python")]
    declared = any(ep.value == "torch_pjrt.vllm:register"
                   for ep in importlib.metadata.entry_points(group="vllm.platform_plugins"))
    if not declared:
        info = tmp_path / "site" / "torch_pjrt_vllm_entry_point-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_pjrt_vllm_entry_point\nVersion: 0\n")
        (info / "entry_points.txt").write_text("[vllm.platform_plugins]\ntorch_pjrt = torch_pjrt.vllm:register\n")
        paths.append(str(tmp_path / "site"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    for name in ("VLLM_TARGET_DEVICE", "TORCH_PJRT_VLLM"):
        env.pop(name, None)
    return env


@needs_vllm
@pytest.mark.modes_inside  # one engine start (~75 s on 2 cores); it runs in the mode make test's pass sets
@pytest.mark.timeout(900)
def test_offline_generate_on_tpu_matches_transformers_greedy(tmp_path):
    model = tiny_llama(tmp_path / "tiny-llama")
    with torch.no_grad():
        want = [[model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts] for prompts in ROUNDS]

    result = tmp_path / "result.json"
    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path / "tiny-llama"), str(result)],
                         env=entry_point_env(tmp_path), cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=840)
    assert run.returncode == 0 and result.exists(), run.stdout[-6000:] + run.stderr[-6000:]
    got = json.loads(result.read_text())
    assert got["platform"] == "torch_pjrt.vllm.platform.TpuPlatform"
    assert got["tokens"] == want
    warm_up = got["warm_up"]
    assert warm_up["tokens"] == [16, 32] and warm_up["requests"] == [1, 2, 4, 8], warm_up
    assert (warm_up["pairs"], warm_up["skipped"]) == (8, []), warm_up
    for phase in ("start", "serving"):
        assert got[phase]["cpu_fallbacks"] == {}, (phase, got[phase]["cpu_fallbacks"])
    assert got["start"]["lowered_ops"].get("aten::_flash_attention_forward", 0) > 0
    # After the warm-up, no step compiled a program or loaded one from the disk cache: every batch shape
    # was a bucket the warm-up had run.
    serving = got["serving"]
    assert (serving["compiles"], serving["disk_cache_hits"]) == (0, 0), serving["recompile_reasons"]


def test_buckets_cover_every_step_shape():
    from torch_pjrt.vllm.buckets import Buckets

    b = Buckets.of(max_num_batched_tokens=48, max_num_seqs=6)
    assert (b.tokens, b.requests) == ((16, 32, 48), (1, 2, 4, 6))
    assert [b.num_tokens(n) for n in (1, 16, 17, 33, 48)] == [16, 16, 32, 48, 48]
    assert [b.num_reqs(n) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    with pytest.raises(ValueError):
        b.num_tokens(49)
    # Every (tokens, requests) a step can have (at least one token per request) pads to a warmed pair.
    assert {(b.num_tokens(t), b.num_reqs(r)) for t in range(1, 49) for r in range(1, min(t, 6) + 1)} == set(b.pairs())
    assert Buckets.of(8, 256).pairs() == [(8, 1), (8, 2), (8, 4), (8, 8)]


def test_the_plugin_steps_aside_when_told(monkeypatch):
    import torch_pjrt.vllm as plugin
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.setenv("TORCH_PJRT_VLLM", "0")
    assert plugin.register() is None
    monkeypatch.setenv("TORCH_PJRT_VLLM", "1")
    assert plugin.register() == "torch_pjrt.vllm.platform.TpuPlatform"
    monkeypatch.delenv("TORCH_PJRT_VLLM")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert plugin.register() is None


def main(model_dir, result_path):
    """The engine's side: one LLM, its warm-up, then one generate() per round with the worker's torch_pjrt metrics
    reset after the warm-up."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, block_size=16, kv_cache_memory_bytes=8 << 20,
              enforce_eager=True)
    start = llm.collective_rpc("torch_pjrt_metrics")[0]
    warm_up = llm.collective_rpc("torch_pjrt_warm_up")[0]
    llm.collective_rpc("torch_pjrt_reset_metrics")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    tokens = []
    for prompts in ROUNDS:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    serving = llm.collective_rpc("torch_pjrt_metrics")[0]
    platform = type(current_platform)
    keys = ("cpu_fallbacks", "lowered_ops", "compiles", "disk_cache_hits", "recompile_reasons")
    with open(result_path, "w") as f:
        json.dump({"platform": f"{platform.__module__}.{platform.__qualname__}", "tokens": tokens, "warm_up": warm_up,
                   "start": {k: start[k] for k in keys}, "serving": {k: serving[k] for k in keys}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
