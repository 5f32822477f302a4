"""Host cost of a step captured in a torch.accelerator.Graph, side by side with the same step run normally.

1. Tiny GPT training step (forward, backward, AdamW; its math takes microseconds, so a
   step's time is host overhead): torch.compile'd (three replayed programs plus PyTorch's
   compiled-call machinery) vs that step captured (one program per replay).
2. A transformers GPT-2 decode step with the static cache (tiny random-init model): eager
   fused mode vs the step captured and replayed per token.

Each pair is measured round-robin (one call of each in turn), so load hits both alike.

    PYTHONPATH=python python benchmarks/bench_graph_capture.py
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

import torch_pjrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compile_backend import captured_stepper, compiled_stepper, tiny_gpt_setup  # noqa: E402

median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731


def side_by_side(steppers, calls):
    wall = {k: [] for k in steppers}
    thread = {k: [] for k in steppers}
    for _ in range(calls):
        for name, step in steppers.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            step()
            wall[name].append(time.perf_counter() - t0)
            thread[name].append(time.thread_time() - c0)
    return {k: (median(wall[k]), median(thread[k])) for k in steppers}


def decode_steppers():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
    from conftest import tiny_model
    from transformers import StaticCache

    model = tiny_model("gpt2").to("tpu")
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(1)).to("tpu")

    def setup():
        cache = StaticCache(config=model.config, max_cache_len=64)
        with torch.no_grad():
            out = model(ids, past_key_values=cache, cache_position=torch.arange(5, device="tpu"), use_cache=True)
        return cache, out.logits[:, -1].argmax(-1, keepdim=True), torch.tensor([5], device="tpu")

    cache_e, tok_e, pos_e = setup()

    def eager():
        with torch.no_grad():
            logits = model(tok_e, past_key_values=cache_e, cache_position=pos_e, use_cache=True).logits[:, -1]
            tok_e.copy_(logits.argmax(-1, keepdim=True))
            pos_e.add_(1)
            return tok_e.item()

    cache_c, tok_c, pos_c = setup()
    graph = torch.accelerator.Graph()
    with torch.no_grad(), graph:
        logits = model(tok_c, past_key_values=cache_c, cache_position=pos_c, use_cache=True).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)

    def captured():
        graph.replay()
        tok_c.copy_(nxt)
        pos_c.add_(1)
        return tok_c.item()

    return {"eager fused": eager, "captured": captured}


def main():
    print("platform:", torch_pjrt.platform())
    compiled, _, _ = compiled_stepper(tiny_gpt_setup)
    captured = captured_stepper(tiny_gpt_setup)
    for _ in range(3):
        compiled(), captured()
    times = side_by_side({"compiled": compiled, "captured": captured}, 300)
    print("tiny GPT training step (forward, backward, AdamW; math takes microseconds):")
    for name, (wall, thread) in times.items():
        print(f"  {name:9s} {wall * 1e3:6.2f} ms per step, calling thread's CPU {thread * 1e3:6.2f} ms")
    print(f"  captured is {times['compiled'][0] / times['captured'][0]:.2f}x faster (goal: host overhead < 1 ms)")
    steppers = decode_steppers()
    for _ in range(3):
        for step in steppers.values():
            step()
    times = side_by_side(steppers, 50)  # tokens 9..58 of GPT-2's 64 positions
    print("GPT-2 (tiny) decode step with the static cache, one token per call:")
    for name, (wall, thread) in times.items():
        print(f"  {name:11s} {wall * 1e3:6.2f} ms per token, calling thread's CPU {thread * 1e3:6.2f} ms")
    print(f"  captured is {times['eager fused'][0] / times['captured'][0]:.2f}x faster")


if __name__ == "__main__":
    main()
