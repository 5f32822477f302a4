"""Dynamic batch sizes under torch.compile(backend="tpu", dynamic=True): batch buckets vs exact sizes.

GPT (benchmarks/gpt_model.py: 4 layers, width 256, sequence 32) called with a stream of batch sizes, each mode
in a fresh process, printed side by side in one run, for inference and for training:

- buckets (default): a graph that keeps its batch rows apart (a training graph: apart from its masked loss)
  runs each size padded to the next power of two and cut back, so a new size inside a seen bucket compiles only
  its input's pad;
- exact (TORCH_PJRT_BATCH_BUCKETS=0): every new size compiles its own program.

Inference: the model's logits. Training: a compiled loss (cross-entropy mean over the batch) with its backward,
and an eager AdamW step. Per mode: XLA compiles and compile seconds over the stream (every size new once), wall
seconds of that cold pass, and the warm per-call time (every size seen). Outputs (inference) and the losses and
final parameters (training) are checked against PyTorch CPU eager.

    PYTHONPATH=python python benchmarks/bench_dynamic_batch.py
"""
import json
import os
import subprocess
import sys
import time

import torch

SIZES = [3, 5, 6, 7, 9, 11, 12, 13, 15, 17, 20, 24, 27, 31]


def measure(train):
    import torch_pjrt
    from torch_pjrt import _compile

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt_model import GPT

    torch.manual_seed(0)
    cpu = GPT(seq=32)
    dev = GPT(seq=32).to("tpu")
    dev.load_state_dict(cpu.state_dict())
    if not train:
        cpu.eval(), dev.eval()
    inputs = {n: torch.randint(0, 512, (n, 33), generator=torch.Generator().manual_seed(n)) for n in SIZES}
    if train:
        def loss_of(model, tokens):
            logits = model(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

        compiled = torch.compile(lambda tokens: loss_of(dev, tokens), backend="tpu", dynamic=True)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (cpu, dev)]

        def call(n, check=False):
            opts[1].zero_grad()
            loss = compiled(inputs[n].to("tpu"))
            loss.backward()
            opts[1].step()
            value = loss.item()
            if check:
                opts[0].zero_grad()
                expected = loss_of(cpu, inputs[n])
                expected.backward()
                opts[0].step()
                return abs(value - expected.item())
            return 0.0
    else:
        compiled = torch.compile(dev, backend="tpu", dynamic=True)

        def call(n, check=False):
            with torch.no_grad():
                out = compiled(inputs[n][:, :-1].to("tpu")).cpu()
                return (out - cpu(inputs[n][:, :-1])).abs().max().item() if check else 0.0

    worst = 0.0
    before = torch_pjrt.metrics()
    start = time.perf_counter()
    for n in SIZES:
        worst = max(worst, call(n, check=True))
    cold = time.perf_counter() - start
    after = torch_pjrt.metrics()
    if train:  # the parameters after the same updates on the same batches
        worst = max(worst, max((p.detach().cpu() - q.detach()).abs().max().item()
                               for p, q in zip(dev.parameters(), cpu.parameters())))
    warm = []
    for _ in range(3):
        for n in SIZES:
            t = time.perf_counter()
            call(n)
            warm.append(time.perf_counter() - t)
    print(json.dumps({"compiles": after["compiles"] - before["compiles"],
                      "compile_s": after["compile_seconds"] - before["compile_seconds"], "cold_s": cold,
                      "warm_ms": sorted(warm)[len(warm) // 2] * 1e3, "bucketed": _compile._bucket_calls[0],
                      "max_abs_diff": worst}))


def main():
    if "--one" in sys.argv:
        return measure("--train" in sys.argv)
    for train in (False, True):
        what = "training step (compiled loss + backward, eager AdamW)" if train else "inference"
        print(f"GPT {what} (4 layers, width 256, seq 32), torch.compile dynamic=True, batch sizes {SIZES}")
        print(f"{'mode':8s} {'compiles':>9s} {'compile s':>10s} {'cold s':>8s} {'warm ms/call':>13s} "
              f"{'bucketed calls':>15s} {'max |diff| vs cpu':>18s}")
        rows = {}
        for mode, flag in (("buckets", "1"), ("exact", "0")):
            env = dict(os.environ, TORCH_PJRT_BATCH_BUCKETS=flag)
            command = [sys.executable, __file__, "--one"] + (["--train"] if train else [])
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
            r = rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{mode:8s} {r['compiles']:9d} {r['compile_s']:10.2f} {r['cold_s']:8.2f} {r['warm_ms']:13.2f} "
                  f"{r['bucketed']:15d} {r['max_abs_diff']:18.2e}")
        b, e = rows["buckets"], rows["exact"]
        print(f"buckets vs exact: compile seconds {e['compile_s'] / max(b['compile_s'], 1e-9):.2f}x less, cold pass "
              f"{e['cold_s'] / b['cold_s']:.2f}x faster, warm call {b['warm_ms'] / e['warm_ms']:.2f}x the time\n")


if __name__ == "__main__":
    main()
