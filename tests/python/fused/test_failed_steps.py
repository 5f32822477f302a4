"""A fused step that fails changes nothing: tensors keep their values from before it.

The failure is a compile failure on a new shape (an injected fault, so XLA
really rejects the program) or an allocation failure while the program runs.
Afterwards parameters and optimizer state read as before the failed step and
training goes on, matching a CPU run that skipped that step.
"""
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def step(model, opt, x, y, mode):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if mode == "lazy":
        torch_pjrt.optimizer_step(opt)
    else:
        opt.step()  # fused mode runs the step's graph here
    return loss.item()


def optimizer_tensors(opt, params):
    """Every tensor of the optimizer's state, in a fixed order."""
    return [(f"{i}.{k}", v) for i, p in enumerate(params) for k, v in sorted(opt.state[p].items())
            if isinstance(v, torch.Tensor)]


def snapshot(model, opt):
    params = list(model.parameters())
    out = {f"param{i}": p.detach().cpu().clone() for i, p in enumerate(params)}
    out.update({k: v.detach().cpu().clone() for k, v in optimizer_tensors(opt, params)})
    return out


def cpu_reference(steps):
    """The same training on the CPU over the given batches (the failed step skipped)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [step(model, opt, x, y, "strict") for x, y in steps]
    return losses, model, opt


@pytest.mark.parametrize("mode", ["fused", "lazy"])
@pytest.mark.parametrize("capturable", [True, False])
def test_compile_failure_on_a_new_shape_leaves_every_tensor_as_it_was(mode, capturable):
    good = [batch(8, seed) for seed in range(4)]
    with torch_pjrt.mode(mode):
        model = make_model().to("tpu")
        # capturable: the step count lives on the device too, so the whole optimizer state is tpu tensors that
        # the failed step must not change; else it is a CPU tensor the step advanced before its graph failed.
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=capturable)
        losses = [step(model, opt, x.to("tpu"), y.to("tpu"), mode) for x, y in good[:2]]
        before = snapshot(model, opt)
        assert {k.split(".")[-1] for k in before if "." in k} == {"step", "exp_avg", "exp_avg_sq"}

        # A new batch size is a new graph: it compiles, and the fault makes XLA reject it.
        x, y = batch(5, 99)
        torch_pjrt._C._inject_compile_fault("aten::tanh")
        try:
            with pytest.raises(RuntimeError) as info:
                opt.zero_grad()
                loss = F.cross_entropy(model(x.to("tpu")), y.to("tpu")); line = inspect.currentframe().f_lineno  # noqa: E702
                loss.backward()
                torch_pjrt.optimizer_step(opt) if mode == "lazy" else opt.step()
        finally:
            torch_pjrt._C._inject_compile_fault("")
        message = str(info.value)
        assert "aten::tanh" in message
        assert f"{__file__}:{line}" in message

        after = snapshot(model, opt)  # every tensor is readable ...
        assert after.keys() == before.keys()
        for k in before:  # ... and exactly as before the failed step
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, msg=k)

        # Training goes on (the fault removed): same numbers as a CPU run without the failed step.
        losses += [step(model, opt, x.to("tpu"), y.to("tpu"), mode) for x, y in good[2:]]
        final = snapshot(model, opt)
    ref_losses, ref_model, ref_opt = cpu_reference(good)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    expected = snapshot(ref_model, ref_opt)
    assert expected.keys() == final.keys()
    for k in expected:
        torch.testing.assert_close(final[k], expected[k].to(final[k].dtype), rtol=1e-4, atol=1e-6, msg=k)


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(1))


def device_born_model():
    torch.manual_seed(0)
    with torch.device("tpu"):
        return Tokens()


def test_a_device_born_model_whose_first_step_fails_keeps_its_initial_values():
    """Built under torch.device("tpu") and never read: its initialization is pending when the first step (a bad
    token id) records. The step's update must not reach the parameters, which keep the values a second model
    built the same way gets."""
    with torch_pjrt.mode("fused"):
        model = device_born_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.tensor([[1, 2, 7]], device="tpu")  # 7: out of range
        with pytest.raises(IndexError, match="index out of range"):
            opt.zero_grad()
            F.cross_entropy(model(tokens), torch.tensor([1], device="tpu")).backward()
            opt.step()
            torch.tpu.synchronize()
        after = [p.detach().cpu() for p in model.parameters()]
        initial = [p.detach().cpu() for p in device_born_model().parameters()]
    for got, expected in zip(after, initial):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not opt.state or all(int(s["step"]) == 0 for s in opt.state.values())


def test_tensors_made_inside_the_failed_step_raise_and_inputs_do_not():
    cpu = torch.randn(10)
    with torch_pjrt.mode("fused"):
        p = cpu.to("tpu")
        torch_pjrt.sync()
        torch_pjrt._C._inject_compile_fault("aten::exp")
        try:
            p.mul_(3)           # an in-place update of a tensor that had a value
            made = torch.exp(p)  # a tensor made inside the failed graph
            with pytest.raises(RuntimeError, match="aten::exp"):
                torch_pjrt.sync()
        finally:
            torch_pjrt._C._inject_compile_fault("")
        torch.testing.assert_close(p.cpu(), cpu, rtol=0, atol=0)  # the update is undone
        with pytest.raises(RuntimeError, match="this tpu tensor has no value: a fused graph"):
            made.cpu()
        p.mul_(3)
        torch.testing.assert_close(torch.exp(p).cpu(), torch.exp(cpu * 3))


RUNTIME_FAILURE = textwrap.dedent("""
    import resource, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    import torch_pjrt
    # A cap on address space makes the plugin's allocation fail at once
    # instead of waking the kernel's OOM killer.
    cap = 16 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    x = torch.randn(8, 4)

    def train_step(extra_elements):
        opt.zero_grad()
        loss = model(x.to("tpu")).square().mean()
        if extra_elements:  # a new shape with a live result far too large for memory
            global big
            big = torch.ones(extra_elements, device="tpu")
            loss = loss + big.sum()
        loss.backward()
        opt.step()
        return loss.item()

    train_step(0)
    before = [t.cpu() for t in list(model.parameters()) + list(opt.state[model.weight].values())]
    try:
        train_step(1 << 34)
        print("NO FAILURE")
        sys.exit(0)
    except RuntimeError as e:
        print("MESSAGE", str(e).replace("\\n", " "))
        print("TYPE", type(e).__name__, isinstance(e, torch.tpu.OutOfMemoryError))
    after = [t.cpu() for t in list(model.parameters()) + list(opt.state[model.weight].values())]
    print("SAME", all(torch.equal(a, b) for a, b in zip(before, after)))
    print("DONATED", torch_pjrt.metrics()["donated_buffers"])
    train_step(0)
    print("GOES_ON", all(torch.isfinite(p).all().item() for p in model.parameters()))

    # A small graph: the CPU plugin reports this allocation failure from the
    # completion event, after Execute returned. Its donated input is still
    # being computed at launch (the plugin would hand it over at once).
    cpu = torch.randn(1000)
    w = torch.rand(1500, 1500, device="tpu")
    for _ in range(4):
        w = (w @ w).sin()
    p = cpu.to("tpu") + 0 * w[0, :1000]
    torch_pjrt.sync()
    p.mul_(2)
    big = torch.ones(1 << 33, device="tpu")
    try:
        big.sum().item()
        print("NO FAILURE")
        sys.exit(0)
    except RuntimeError as e:
        print("MESSAGE2", str(e).replace("\\n", " "))
    print("SAME2", torch.equal(p.cpu(), cpu))

    # A model made on the device, nothing read, whose first step runs out of memory: its parameters keep the
    # values of its initialization (a twin built the same way shows them).
    def born():
        torch.manual_seed(1)
        with torch.device("tpu"):
            return nn.Linear(4, 2)
    model = born()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    big = None
    try:
        train_step(1 << 34)
        print("NO FAILURE")
        sys.exit(0)
    except RuntimeError as e:
        pass
    try:
        twin = born()
        print("BORN", all(torch.equal(p.cpu(), q.cpu()) for p, q in zip(model.parameters(), twin.parameters())))
    except RuntimeError as e:
        print("BORN lost:", str(e)[:200])
""")


def run_capped(script, mode):
    """Runs `script` in a fresh interpreter in `mode` (it caps its own address space)."""
    env = dict(os.environ, TORCH_PJRT_MODE=mode)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(torch_pjrt.__path__[0]),
                                                      env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch_pjrt.platform()["name"] != "cpu",
                    reason="caps the address space, which a GPU runtime needs far more of at start")
def test_out_of_memory_while_running_leaves_every_tensor_as_it_was():
    proc = run_capped(RUNTIME_FAILURE, "fused")
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "NO FAILURE" in out:
        pytest.skip("the plugin allocated the oversized output; no run-time failure to test")
    assert "Out of memory" in out, out
    assert "TYPE OutOfMemoryError True" in out, out  # what accelerate's batch-size finder catches
    assert "SAME True" in out, out
    assert "DONATED 0" not in out, out  # donation stayed on for the steps that ran
    assert "GOES_ON True" in out, out
    assert "SAME2 True" in out, out
    assert "BORN True" in out, out


STRICT_FAILURE = textwrap.dedent("""
    import resource
    import torch, torch_pjrt
    cap = 12 << 30
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    x = torch.ones(4, device="tpu")
    try:  # each program's output fits; the third one's does not: it fails after its launch
        a = torch.ones(1 << 30, device="tpu")
        b = a * 2
        c = b + a
        d = c * 3
        d[:2].cpu()
        print("NO FAILURE")
    except torch.OutOfMemoryError as e:
        print("RAISED", str(e).replace("\\n", " ")[:300])
    for k in range(2):  # unrelated ops after it run, and do not raise it again
        print("NEXT", torch.ones(3, device="tpu").sum().item(), (x + 1).sum().item())
""")


@pytest.mark.skipif(torch_pjrt.platform()["name"] != "cpu",
                    reason="caps the address space, which a GPU runtime needs far more of at start")
def test_strict_out_of_memory_is_raised_once():
    proc = run_capped(STRICT_FAILURE, "strict")
    out = proc.stdout
    if "NO FAILURE" in out:
        pytest.skip("the plugin allocated every output; no run-time failure to test")
    assert "RAISED" in out and "Out of memory" in out, out + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.count("NEXT 3.0 8.0") == 2, out
