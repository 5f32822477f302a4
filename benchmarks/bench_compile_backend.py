"""torch.compile(backend="tpu") benchmark: the GPT training step of bench_fused.py
(4 layers, width 256, batch 4, sequence 128, AdamW) compiled vs fused vs strict vs
PyTorch CPU eager vs the same step as one jax.jit program (if jax is installed),
side by side in one run, measured round-robin (one step of each in turn, so a
busy machine slows every column alike); then the same at batch 1, sequence 16
(host-bound), and the XLA programs per compiled step. "jax on plugin" is the
same jax program run by torch_pjrt's PJRT plugin (through jax_op): the same XLA
build as the compiled column, unlike jax's own XLA:CPU. Then host overhead: fused recording per op
against PyTorch CPU eager's whole cost per op on tiny tensors, and a compiled
step's host overhead (the same step on a GPT whose math takes microseconds).

Compiled step: forward + loss under torch.compile (one forward program), its
AOTAutograd backward (one program), and torch.compile(opt.step) of a capturable
AdamW (one program); after the first calls each is replayed (no op dispatch).

    PYTHONPATH=python python benchmarks/bench_compile_backend.py
"""
import os
import sys
import time

import torch
import torch.nn.functional as F

import torch_pjrt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused import GPT, gpt_setup, gpt_small_batch_setup, step_time, training_step  # noqa: E402

median = lambda v: sorted(v)[len(v) // 2]  # noqa: E731 - a 2-core machine has noisy neighbours


def jax_step_time(setup, steps, on_plugin=False):
    """The same step as one jax.jit program (jax_gpt.py), from the same initial weights; None without jax.

    on_plugin: the same jax program compiled and run by torch_pjrt's PJRT plugin (through jax_op)
    instead of jax's own XLA:CPU, which is a different XLA build."""
    try:
        import jax  # noqa: F401
    except ImportError:
        return None
    import jax_gpt

    torch.manual_seed(0)
    model, x, y = setup("cpu")
    trainer_type = jax_gpt.PluginTrainer if on_plugin else jax_gpt.JaxTrainer
    trainer = trainer_type(model, x, y, layers=len(model.blocks), heads=model.blocks[0].heads)
    for _ in range(2):  # compile
        trainer.step()
    times, thread = [], []
    for _ in range(steps):
        thread_start = time.thread_time()
        start = time.perf_counter()
        trainer.step()  # float(loss): waits for the step
        times.append(time.perf_counter() - start)
        thread.append(time.thread_time() - thread_start)
    jax_step_time.thread = median(thread)
    return median(times)


def compiled_pieces(setup):
    """The compiled training step's pieces: (x, y, opt, loss_of, opt_step), loss and AdamW step compiled."""
    torch._dynamo.reset()
    with torch_pjrt.mode("fused"):
        torch.manual_seed(0)
        model, x, y = setup("tpu")
        # capturable: the step counts live on the device, so the compiled
        # step's graph has only tpu inputs and replays (CPU step counts would
        # make it run op by op on every call).
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    @torch.compile(backend="tpu")
    def loss_of(x, y):
        return F.cross_entropy(model(x).flatten(0, -2), y.flatten())

    return x, y, opt, loss_of, torch.compile(opt.step, backend="tpu")


def compiled_step_time(setup, steps):
    x, y, opt, loss_of, opt_step = compiled_pieces(setup)
    with torch_pjrt.mode("fused"):
        def step():
            opt.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            opt_step()
            return loss.item()

        for _ in range(3):  # compile (the first AdamW step differs from later ones)
            step()
        before = torch_pjrt.metrics()
        step()
        after = torch_pjrt.metrics()
        programs = after["executions"] - before["executions"]
        replays = after["compiled_replays"] - before["compiled_replays"]
        times, host, thread = [], [], []
        for _ in range(steps):
            thread_start = time.thread_time()
            start = time.perf_counter()
            opt.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            opt_step()
            dispatched = time.perf_counter()  # the programs are enqueued, not finished
            loss.item()
            end = time.perf_counter()
            times.append(end - start)
            host.append(dispatched - start)
            thread.append(time.thread_time() - thread_start)
        compiled_step_time.thread = median(thread)  # the calling thread's CPU time per step
        return median(times), median(host), programs, replays


def eager_stepper(setup, device, mode):
    """A training step of the model in this mode (PyTorch's own CPU eager for device "cpu")."""
    with torch_pjrt.mode(mode):
        inner = training_step(setup, device)

    def step():
        with torch_pjrt.mode(mode):
            return inner()

    return step


def compiled_stepper(setup):
    """The compiled training step (see compiled_step_time); (step, XLA programs per step, replayed)."""
    x, y, opt, loss_of, opt_step = compiled_pieces(setup)

    def step():
        with torch_pjrt.mode("fused"):
            opt.zero_grad()
            loss = loss_of(x, y)
            loss.backward()
            opt_step()
            return loss.item()

    for _ in range(3):  # compile (the first AdamW step differs from later ones)
        step()
    before = torch_pjrt.metrics()
    step()
    after = torch_pjrt.metrics()
    return step, after["executions"] - before["executions"], after["compiled_replays"] - before["compiled_replays"]


def captured_stepper(setup):
    """The compiled training step captured once in a torch.accelerator.Graph: each call is a
    replay (one XLA program, no Python, dispatch or recording) and the loss read back."""
    x, y, opt, loss_of, opt_step = compiled_pieces(setup)

    def eager_step():
        opt.zero_grad()
        loss = loss_of(x, y)
        loss.backward()
        opt_step()
        return loss

    with torch_pjrt.mode("fused"):
        for _ in range(3):  # compile the pieces, as before a CUDA graph capture
            eager_step().item()
        graph = torch.accelerator.Graph()
        with graph:
            loss = eager_step()

    def step():
        graph.replay()
        return loss.item()

    return step


def round_robin(steppers, steps):
    """Median seconds per call of each stepper, called one after another `steps` times, so that
    load from other processes hits every column alike."""
    times = {name: [] for name in steppers}
    for _ in range(steps):
        for name, step in steppers.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: median(t) for name, t in times.items()}


def interleaved_step_times(setup, steps):
    """Median step time per way of running the step, measured round-robin (one step of each in
    turn), so that load from other processes hits every column alike."""
    steppers = {"cpu eager": eager_stepper(setup, "cpu", "strict")}
    for mode in ("strict", "fused"):
        steppers["tpu " + mode] = eager_stepper(setup, "tpu", mode)
    steppers["tpu compiled"], programs, replays = compiled_stepper(setup)
    steppers["tpu captured"] = captured_stepper(setup)
    try:
        import jax  # noqa: F401
        import jax_gpt

        for name, trainer_type in (("jax.jit", jax_gpt.JaxTrainer), ("jax on plugin", jax_gpt.PluginTrainer)):
            torch.manual_seed(0)
            model, x, y = setup("cpu")
            with torch_pjrt.mode("fused"):
                trainer = trainer_type(model, x, y, layers=len(model.blocks), heads=model.blocks[0].heads)
            steppers[name] = trainer.step
    except ImportError:
        pass
    for step in steppers.values():  # compile / warm up
        step()
        step()
    return round_robin(steppers, steps), programs, replays


def tiny_gpt_setup(device):
    """The GPT's 4 layers and op sequence at width 16, batch 1, sequence 8: its math takes
    microseconds, so a step's time is its host overhead (plus a few tiny program runs)."""
    model = GPT(vocab=32, width=16, layers=4, heads=2, seq=8).to(device)
    idx = torch.randint(0, 32, (1, 8))
    return model, idx.to(device), idx.roll(-1, 1).to(device)


def per_op_recording_cost(n=500):
    """(fused recording us/op, PyTorch CPU eager us/op) of `b = b + 1.0` on a 4x4 tensor."""
    def loop(a):
        start = time.perf_counter()
        b = a
        for _ in range(n):
            b = b + 1.0
        return (time.perf_counter() - start) / n * 1e6, b

    a = torch.randn(4, 4, device="tpu")
    fused = []
    with torch_pjrt.mode("fused"):
        for _ in range(5):
            us, b = loop(a)  # recorded only: the graph runs at the cut below
            b.cpu()
            fused.append(us)
    cpu = [loop(a.cpu())[0] for _ in range(5)]
    return median(fused), median(cpu)


def fused_step_cost(setup, steps=9):
    """(fused step ms, ops recorded per step) on the tiny GPT: host time per recorded op."""
    with torch_pjrt.mode("fused"):
        torch.manual_seed(0)
        model, x, y = setup("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times, ops = [], []
        for i in range(steps + 2):
            before = torch_pjrt.metrics()["fused_ops"]
            start = time.perf_counter()
            opt.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
            loss.backward()
            opt.step()
            loss.item()
            if i >= 2:
                times.append(time.perf_counter() - start)
                ops.append(torch_pjrt.metrics()["fused_ops"] - before)
        return median(times), median(ops)


def host_overhead():
    print("\n== host overhead ==")
    fused_us, cpu_us = per_op_recording_cost()
    print(f"tiny tensors (4x4 add, 500 ops): fused recording {fused_us:.1f} us/op, PyTorch CPU eager "
          f"{cpu_us:.1f} us/op: recording costs {fused_us / cpu_us:.2f}x PyTorch's own per-op cost")
    step, ops = fused_step_cost(tiny_gpt_setup)
    cpu_step = step_time(tiny_gpt_setup, "cpu", "strict", 9)
    print(f"tiny GPT training step (4 layers, width 16, seq 8): fused {step * 1e3:.2f} ms for {ops} recorded ops "
          f"= {step / ops * 1e6:.1f} us/op (recording, lowering-cache lookups, launch and run); PyTorch CPU eager "
          f"{cpu_step * 1e3:.2f} ms")
    compiled, _, programs, replays = compiled_step_time(tiny_gpt_setup, 15)
    jax_time = jax_step_time(tiny_gpt_setup, 15)
    compiled_thread = compiled_step_time.thread
    jax_text = (f"; the step as one jax.jit program: {jax_time * 1e3:.2f} ms, calling thread's CPU "
                f"{jax_step_time.thread * 1e3:.2f} ms" if jax_time else "")
    print(f"compiled step host overhead (tiny GPT, math takes microseconds): {compiled * 1e3:.2f} ms per step, "
          f"calling thread's CPU time {compiled_thread * 1e3:.2f} ms (goal < 1 ms; on the CPU plugin it includes "
          f"any program the thread runs inline), {programs} programs ({replays} replayed){jax_text}")
    captured = captured_stepper(tiny_gpt_setup)
    times, thread = [], []
    for _ in range(200):
        thread_start, start = time.thread_time(), time.perf_counter()
        captured()
        times.append(time.perf_counter() - start)
        thread.append(time.thread_time() - thread_start)
    print(f"the same step captured in a torch.accelerator.Graph (one program per replay): {median(times) * 1e3:.2f} ms "
          f"per step, calling thread's CPU time {median(thread) * 1e3:.2f} ms (goal < 1 ms)")


def main():
    print("platform:", torch_pjrt.platform())
    for name, setup, steps in [("GPT 4x256, batch 4, seq 128", gpt_setup, 7),
                               ("GPT 4x256, batch 1, seq 16 (host-bound)", gpt_small_batch_setup, 15)]:
        print(f"\n== {name}: training step (forward, backward, AdamW), measured round-robin ==")
        times, programs, replays = interleaved_step_times(setup, steps)
        cpu, compiled = times["cpu eager"], times["tpu compiled"]
        for column, t in times.items():
            print(f"{column:14s} {t * 1e3:9.1f} ms/step  {cpu / t:5.2f}x cpu eager  compiled is "
                  f"{t / compiled:5.2f}x faster")
        print(f"compiled: {programs} XLA programs per step, {replays} of them replayed")
        if "jax.jit" in times:
            print(f"compiled / jax.jit = {compiled / times['jax.jit']:.2f} (goal <= 1.1; jax's own XLA:CPU build), "
                  f"compiled / jax on plugin = {compiled / times['jax on plugin']:.2f} (the same jax program "
                  "compiled and run by torch_pjrt's plugin); compiled vs fused: "
                  f"{times['tpu fused'] / compiled:.2f}x faster (goal >= 1.3)")
            print(f"captured (the compiled step in a torch.accelerator.Graph, one program per step) / jax.jit = "
                  f"{times['tpu captured'] / times['jax.jit']:.2f}, captured / jax on plugin = "
                  f"{times['tpu captured'] / times['jax on plugin']:.2f}")
        else:
            print("jax.jit: jax is not installed (pip install jax) - no baseline")
    host_overhead()


if __name__ == "__main__":
    main()
