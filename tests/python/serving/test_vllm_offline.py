"""vLLM's offline LLM.generate on tpu through torch_pjrt's platform plugin (torch_pjrt.vllm, docs/serving.md):
greedy tokens of a tiny random-init Llama equal transformers' generate() on the CPU, with no CPU fallback in the
engine's process, and nothing compiles after the engine's warm-up of its token and request buckets: one engine
runs batches of different sizes, a lone prompt after a batch, chunked prefills (max_num_batched_tokens=32), the
same prompts again (prefix-cache hits) and a batch of five. Then sampling (SAMPLING): seeded requests with
temperature, top-k and top-p give the same tokens when run again (in another order), other seeds other tokens,
every sampled token is one its top-k/top-p allow under the CPU model's logits, and logprobs (the sampled token's
and the top k, with ranks) match log_softmax of the CPU model's float32 logits. Nothing compiles after the
warm-up, neither torch_pjrt programs nor Dynamo graphs (vLLM's torch.compile'd sampler helpers).

The engine runs in a child process (this file run as a script), as a user's script would: vLLM spawns its
engine core and sets process-wide state (logging, torch settings) that the test process must not keep.
vLLM finds the platform through the `vllm.platform_plugins` entry point; where torch_pjrt is not installed
(tests run from the source tree), the child gets a stand-in distribution's metadata that declares it."""
import json
import os
import subprocess
import sys

import pytest
import torch

from _tiny import entry_point_env, greedy, needs_vllm, reference_logprobs, tiny_llama

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

# Sampling, after the greedy rounds (the same engine): one batch of these requests, then the same requests again in
# the reverse order. Seeded requests repeat their tokens, other seeds give other tokens; logprobs (vLLM's raw
# logprobs: log_softmax of the model's logits, before temperature, top-k and top-p) match the CPU model's; each
# sampled token is one that temperature, top-k and top-p allow under the CPU model's logits.
SAMPLED_NEW_TOKENS = 8
A, B = _prompt(6, 10), _prompt(13, 11)
SAMPLING = [
    (A, dict(temperature=1.0, top_k=5, seed=1234, logprobs=5)),
    (A, dict(temperature=1.0, top_k=5, seed=4321, logprobs=5)),
    (B, dict(temperature=0.8, top_p=0.5, seed=7, logprobs=3)),
    (B, dict(temperature=0.8, top_p=0.5, seed=8)),
    (B, dict(temperature=1.5, top_k=16, top_p=0.9, seed=7, logprobs=16)),
    (A, dict(temperature=0.0, logprobs=5)),
    (B, dict(temperature=0.0, logprobs=5)),
]
# float32 logprobs on tpu (the CPU PJRT plugin) against float32 torch on the CPU: the two differ by the order of
# their sums (at most 1e-6 measured, on logprobs of about -5.5); 1e-4 leaves room without hiding a wrong row (the
# top logprobs of a row here are 1e-5 to 1e-2 apart, so the top sets and ranks are compared exactly).
LOGPROB_ATOL = 1e-4
# A token whose place in top-p's cumulative sum is within this of the cut counts as allowed: the cut is computed on
# logits a few ulps apart.
TOP_P_SLACK = 1e-4


@needs_vllm
@pytest.mark.modes_inside  # one engine start (~75 s on 2 cores); it runs in the mode make test's pass sets
@pytest.mark.timeout(900)
def test_offline_generate_on_tpu_matches_transformers_greedy(tmp_path):
    model = tiny_llama(tmp_path / "tiny-llama")
    want = [[greedy(model, p, NEW_TOKENS) for p in prompts] for prompts in ROUNDS]

    result = tmp_path / "result.json"
    run = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path / "tiny-llama"), str(result)],
                         env=entry_point_env(tmp_path), cwd=str(tmp_path), capture_output=True, text=True,
                         timeout=840)
    assert run.returncode == 0 and result.exists(), run.stdout[-6000:] + run.stderr[-6000:]
    got = json.loads(result.read_text())
    assert got["platform"] == "torch_pjrt.vllm.platform.TpuPlatform"
    assert got["tokens"] == want
    check_sampling(model, got["sampling"])
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
    assert serving["recompile_reasons"] == []  # what torch_pjrt.explain() lists in the worker: nothing recompiled
    # Nor did Dynamo trace anything: the sampler's torch.compile'd logprob ranks were traced by the warm-up.
    assert got["start"]["dynamo_graphs"] >= 1 and serving["dynamo_graphs"] == got["start"]["dynamo_graphs"], got


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


def test_the_plugin_steps_aside_on_a_libtpu_host(monkeypatch, tmp_path):
    """Where `libtpu` is importable (a real TPU host: vLLM's own TPU platform is wanted) and TORCH_PJRT_PLUGIN is
    unset, register() steps aside; TORCH_PJRT_PLUGIN or TORCH_PJRT_VLLM=1 chooses torch_pjrt there."""
    import torch_pjrt.vllm as plugin
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    for name in ("VLLM_TARGET_DEVICE", "TORCH_PJRT_VLLM", "TORCH_PJRT_PLUGIN"):
        monkeypatch.delenv(name, raising=False)
    assert plugin.register() == plugin.PLATFORM  # no libtpu yet
    monkeypatch.syspath_prepend(str(tmp_path))
    assert plugin.register() is None
    monkeypatch.setenv("TORCH_PJRT_VLLM", "1")
    assert plugin.register() == plugin.PLATFORM
    monkeypatch.delenv("TORCH_PJRT_VLLM")
    monkeypatch.setenv("TORCH_PJRT_PLUGIN", "cpu")  # the plugin these tests run on, named
    assert plugin.register() == plugin.PLATFORM


def allowed_tokens(logprobs, temperature, top_k=None, top_p=None):
    """The token ids vLLM's sampler may draw from a row of raw logprobs (float64, computed as vLLM's torch sampler
    does: temperature, then the top-k values, then the top-p nucleus over what is left), with TOP_P_SLACK."""
    logits = logprobs.double() / temperature
    if top_k is not None:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    if top_p is not None:
        ascending, order = logits.sort()
        cut = ascending.softmax(-1).cumsum(-1) <= 1 - top_p - TOP_P_SLACK
        cut[-1] = False
        logits = logits.clone()
        logits[order[cut]] = float("-inf")
    return set(torch.nonzero(logits > float("-inf")).flatten().tolist())


def check_sampling(model, sampling):
    """The sampling rounds' outputs (main): reproducible seeds, other seeds differ, logprobs against the CPU model,
    every sampled token allowed by its request's temperature, top-k and top-p."""
    first, again = sampling
    tokens = [out["tokens"] for out in first]
    assert [out["tokens"] for out in again] == tokens  # the same requests in the reverse order: the same tokens
    for out, out_again in zip(first, again):  # and the same logprobs (other rows of the batch: a few ulps apart)
        for row, row_again in zip(out["logprobs"] or [], out_again["logprobs"] or []):
            assert [(t, rank) for t, _, rank in row] == [(t, rank) for t, _, rank in row_again]
            assert max(abs(x[1] - y[1]) for x, y in zip(row, row_again)) <= 1e-5, (row, row_again)
    assert tokens[0] != tokens[1] and tokens[2] != tokens[3], tokens  # seeds 1234 vs 4321, 7 vs 8
    for (prompt, params), out in zip(SAMPLING, first):
        assert len(out["tokens"]) == SAMPLED_NEW_TOKENS, (params, out)
        if params["temperature"] == 0.0:
            assert out["tokens"] == greedy(model, prompt, SAMPLED_NEW_TOKENS), params
        ref = reference_logprobs(model, prompt, out["tokens"])
        for pos, token in enumerate(out["tokens"]):
            if params["temperature"] > 0.0:
                allowed = allowed_tokens(ref[pos], params["temperature"], params.get("top_k"), params.get("top_p"))
                assert token in allowed, (params, pos, token, sorted(allowed))
            if "logprobs" not in params:
                continue
            # vLLM's row: the sampled token and the top `logprobs` tokens, each with its logprob and rank.
            row = {int(t): (lp, rank) for t, lp, rank in out["logprobs"][pos]}
            top = ref[pos].topk(params["logprobs"]).indices.tolist()
            assert set(row) == set(top) | {token}, (params, pos, sorted(row), sorted(top), token)
            for t, (lp, rank) in row.items():
                assert abs(lp - ref[pos, t].item()) <= LOGPROB_ATOL, (params, pos, t, lp, ref[pos, t].item())
                assert rank == 1 + int((ref[pos] > ref[pos, t]).sum()), (params, pos, t, rank)
            if "top_k" in params:  # what vLLM itself says: the sampled token ranks within the top k
                assert row[token][1] <= params["top_k"], (params, pos, token, row[token])


def run_sampling(llm):
    """SAMPLING once, then reversed; per request its tokens and logprob rows [[token, logprob, rank], ...]."""
    from vllm import SamplingParams

    def run(order):
        requests = [SAMPLING[i] for i in order]
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in requests],
                               [SamplingParams(max_tokens=SAMPLED_NEW_TOKENS, ignore_eos=True, detokenize=False,
                                               **params) for _, params in requests], use_tqdm=False)
        got = [None] * len(SAMPLING)
        for i, output in zip(order, outputs):
            completion = output.outputs[0]
            rows = None
            if completion.logprobs is not None:
                rows = [[[t, lp.logprob, lp.rank] for t, lp in position.items()] for position in completion.logprobs]
            got[i] = {"tokens": list(completion.token_ids), "logprobs": rows}
        return got

    order = list(range(len(SAMPLING)))
    return [run(order), run(order[::-1])]


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
    sampling = run_sampling(llm)
    serving = llm.collective_rpc("torch_pjrt_metrics")[0]
    platform = type(current_platform)
    keys = ("cpu_fallbacks", "lowered_ops", "compiles", "disk_cache_hits", "recompile_reasons", "dynamo_graphs")
    with open(result_path, "w") as f:
        json.dump({"platform": f"{platform.__module__}.{platform.__qualname__}", "tokens": tokens, "sampling": sampling,
                   "warm_up": warm_up,
                   "start": {k: start[k] for k in keys}, "serving": {k: serving[k] for k in keys}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
