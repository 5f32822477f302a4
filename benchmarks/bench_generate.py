"""Greedy generation benchmark: tiny random-init GPT-2 and Llama (transformers), prints side by side in one run

- tokens/s of `model.generate(max_new_tokens=N)` on the CPU (eager) and on tpu, cold (first call: compiles)
  and warm (the same call again: every program cached);
- compiles per generated token after warm-up inside the cold call (after the first 2 tokens), in the warm call,
  and per token (after the first 2) of a generate() whose prompt has a new length (`new len`: a new prefill, then
  the steady state); whether the tokens equal the CPU's (each row in a fresh process: no program compiled before it);

for the default dynamic KV cache and `cache_implementation="static"`, in fused and strict mode, for one prompt
and a batch of 2 prompts (input_ids and attention_mask grow by a column per row, a dynamic cache by a row per head: row cats);
`--left-pad` adds batches whose second prompt is 3 tokens shorter, left-padded (a mask with zeros), for both caches.

    PYTHONPATH=python python benchmarks/bench_generate.py [--tokens 16] [--modes fused,strict] [--batches 1,2] [--left-pad]
"""
import argparse
import subprocess
import sys
import time
import warnings

import torch
import transformers

import torch_pjrt


def tiny_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=128,
                                         bos_token_id=1, eos_token_id=2)
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=128, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


class CompileCounter(transformers.StoppingCriteria):
    """Records the process's compile count after every generated token; never stops."""

    def __init__(self):
        self.counts = []

    def __call__(self, input_ids, scores, **kwargs):
        self.counts.append(torch_pjrt.metrics()["compiles"])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run(model, ids, cache, tokens, sync, mask=None):
    counter = CompileCounter()
    kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
              stopping_criteria=transformers.StoppingCriteriaList([counter]))
    if cache == "static":
        kw.update(cache_implementation="static", disable_compile=True)
    start = time.perf_counter()
    if mask is not None:
        kw["attention_mask"] = mask
    with torch.no_grad():
        out = model.generate(ids, **kw)
    out = out.cpu()
    sync()
    return out, time.perf_counter() - start, counter.counts


def left_padded(ids):
    """The last prompt 3 tokens shorter, padded on the left: (ids, attention_mask)."""
    ids, mask = ids.clone(), torch.ones_like(ids)
    ids[-1, :3], mask[-1, :3] = 0, 0
    return ids, mask


def measure(kind, cache, mode, tokens, batch=1, pad=False):
    """One row, in a fresh process: nothing compiled before it."""
    ids = torch.randint(3, 128, (batch, 8), generator=torch.Generator().manual_seed(1))
    mask = None
    if pad:
        ids, mask = left_padded(ids)
    model = tiny_model(kind)
    expected, _, _ = run(model, ids, cache, tokens, lambda: None, mask)  # CPU warm-up
    _, cpu_s, _ = run(model, ids, cache, tokens, lambda: None, mask)
    model.to("tpu")
    dev_mask = None if mask is None else mask.to("tpu")
    with torch_pjrt.mode(mode):
        out, cold_s, counts = run(model, ids.to("tpu"), cache, tokens, torch.tpu.synchronize, dev_mask)
        per_token = (counts[-1] - counts[1]) / max(len(counts) - 2, 1)
        before = torch_pjrt.metrics()["compiles"]
        _, warm_s, _ = run(model, ids.to("tpu"), cache, tokens, torch.tpu.synchronize, dev_mask)
        warm_compiles = torch_pjrt.metrics()["compiles"] - before
        other = torch.randint(3, 128, (batch, 11), generator=torch.Generator().manual_seed(2))
        other_mask = None
        if pad:
            other, other_mask = left_padded(other)
            other_mask = other_mask.to("tpu")
        _, _, new_counts = run(model, other.to("tpu"), cache, tokens, torch.tpu.synchronize, other_mask)
        new_len = (new_counts[-1] - new_counts[1]) / max(len(new_counts) - 2, 1)
    label = f"{batch}{'p' if pad else ''}"
    print(f"{kind:6s} {cache:8s} {label:>5s} {mode:7s} {tokens / cpu_s:10.1f} {tokens / cold_s:11.1f} {tokens / warm_s:11.1f} "
          f"{cpu_s / warm_s:8.2f}x {per_token:14.1f} {warm_compiles:10d} {new_len:13.1f} "
          f"{str(torch.equal(out, expected)):>5s}",
          flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--modes", default="fused,strict")
    parser.add_argument("--batches", default="1,2", help="prompts per generate()")
    parser.add_argument("--left-pad", action="store_true", help="also batches with a left-padded prompt (batch NNp)")
    parser.add_argument("--one", help="kind,cache,mode,batch[p]: measure one row in this process (p: left-padded)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.one:
        kind, cache, mode, batch = args.one.split(",")
        return measure(kind, cache, mode, args.tokens, int(batch.rstrip("p")), batch.endswith("p"))
    print("platform:", torch_pjrt.platform())
    print(f"{'model':6s} {'cache':8s} {'batch':>5s} {'mode':7s} {'cpu tok/s':>10s} {'cold tok/s':>11s} {'warm tok/s':>11s} "
          f"{'warm/cpu':>9s} {'cold comp/tok':>14s} {'warm comp':>10s} {'new len c/tok':>13s} {'same':>5s}", flush=True)
    rows = [(cache, 1) for cache in ("dynamic", "static")]
    rows += [(cache, int(b)) for cache in ("dynamic", "static") for b in args.batches.split(",") if int(b) > 1]
    if args.left_pad:
        rows += [(cache, f"{b}p") for cache in ("dynamic", "static") for b in args.batches.split(",") if int(b) > 1]
    for kind in ("gpt2", "llama"):
        for cache, batch in rows:
            for mode in args.modes.split(","):
                subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--one",
                                f"{kind},{cache},{mode},{batch}"], check=True, stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
