"""vLLM's offline LLM.generate on tpu through torch_pjrt's platform plugin (torch_pjrt.vllm, docs/serving.md):
greedy tokens of a tiny random-init Llama equal transformers' generate() on the CPU, for three prompts of
different lengths batched together, with no CPU fallback in the engine's process.

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
        want = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]

    result = tmp_path / "result.json"
    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path / "tiny-llama"), str(result)],
                         env=entry_point_env(tmp_path), cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=840)
    assert run.returncode == 0 and result.exists(), run.stdout[-6000:] + run.stderr[-6000:]
    got = json.loads(result.read_text())
    assert got["platform"] == "torch_pjrt.vllm.platform.TpuPlatform"
    assert got["tokens"] == want
    assert got["metrics"]["cpu_fallbacks"] == {}, got["metrics"]["cpu_fallbacks"]
    assert got["metrics"]["lowered_ops"].get("aten::_flash_attention_forward", 0) > 0


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
    """The engine's side: one LLM, one generate() of the three prompts, the worker's torch_pjrt metrics."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=8,
              block_size=16, kv_cache_memory_bytes=8 << 20, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    metrics = llm.collective_rpc("torch_pjrt_metrics")[0]
    platform = type(current_platform)
    with open(result_path, "w") as f:
        json.dump({"platform": f"{platform.__module__}.{platform.__qualname__}",
                   "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                   "metrics": {k: metrics[k] for k in ("cpu_fallbacks", "lowered_ops", "compiles")}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
