"""The execution mode is per thread: a thread's own mode (torch_pjrt.thread_mode, a compiled call's scope)
changes that thread alone; every other thread keeps the process's mode (TORCH_PJRT_MODE, set_mode).

Each case holds thread A inside its scope while thread B works, so the two overlap for certain, and checks
both threads' numbers against CPU PyTorch.
"""
import threading

import pytest
import torch

import torch_pjrt
from torch_pjrt import _compile_backend

pytestmark = pytest.mark.modes_inside  # sets the process's mode itself


def _fused_ops():
    return torch_pjrt.metrics()["fused_ops"]


def _work(seed):
    """A few ops on tpu and on the CPU: (tpu result on the host, CPU result)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(6, 5, generator=g), torch.randn(5, 4, generator=g)
    want = torch.relu(a @ b).sum(0) * 3 + 1
    got = torch.relu(a.to("tpu") @ b.to("tpu")).sum(0) * 3 + 1
    return got.cpu(), want


def _overlap(scope, in_scope, outside):
    """Runs in_scope() on a thread inside `scope()` while outside() runs on this thread; returns both results."""
    entered, done = threading.Event(), threading.Event()
    result, errors = {}, []

    def body():
        try:
            with scope():
                entered.set()
                assert done.wait(120)
                result["a"] = in_scope()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            entered.set()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    try:
        assert entered.wait(120)
        result["b"] = outside()
    finally:
        done.set()
        t.join(120)
    assert not t.is_alive(), "the scoped thread did not finish"
    if errors:
        raise errors[0]
    return result["a"], result["b"]


@pytest.mark.parametrize("process", ["strict", "debug", "fused", "lazy"])
def test_compile_scope_changes_only_its_thread(process):
    with torch_pjrt.mode(process):
        def inside():
            assert torch_pjrt.get_mode() == "fused"  # the compiled call records
            assert _compile_backend.user_mode() == process  # what its own code runs in
            return _work(1)

        def outside():
            assert torch_pjrt.get_mode() == process
            assert _compile_backend.user_mode() == process
            before = _fused_ops()
            out = _work(2)
            if process in ("strict", "debug"):
                # Thread A records nothing while it waits: B's ops ran in B's mode, one at a time.
                assert _fused_ops() == before
            return out

        (got_a, want_a), (got_b, want_b) = _overlap(_compile_backend._OneProgram, inside, outside)
        torch.testing.assert_close(got_a, want_a)
        torch.testing.assert_close(got_b, want_b)
        assert torch_pjrt.get_mode() == process  # this thread's mode never changed


def test_thread_mode_changes_only_its_thread():
    with torch_pjrt.mode("fused"):
        def inside():
            assert torch_pjrt.get_mode() == "strict"
            before = _fused_ops()
            out = _work(3)
            assert _fused_ops() == before  # ran op by op: nothing recorded
            return out

        def outside():
            assert torch_pjrt.get_mode() == "fused"
            before = _fused_ops()
            out = _work(4)
            assert _fused_ops() > before  # recorded: the other thread's strict mode is not this one's
            return out

        (got_a, want_a), (got_b, want_b) = _overlap(lambda: torch_pjrt.thread_mode("strict"), inside, outside)
        torch.testing.assert_close(got_a, want_a)
        torch.testing.assert_close(got_b, want_b)


def test_thread_mode_ends_with_the_process_mode_of_then():
    with torch_pjrt.mode("strict"):
        with torch_pjrt.thread_mode("debug"):
            assert torch_pjrt.get_mode() == "debug"
            torch_pjrt.set_mode("fused")  # the process's mode; this thread keeps its own
            assert torch_pjrt.get_mode() == "debug"
            with torch_pjrt.mode("lazy"):  # restores the process's mode, not this thread's
                assert torch_pjrt.get_mode() == "debug"
            got, want = _work(5)
        assert torch_pjrt.get_mode() == "fused"
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="unknown torch_pjrt mode"):
        with torch_pjrt.thread_mode("turbo"):
            pass


def test_thread_records_until_its_mode_changes():
    """Ops a thread recorded in fused mode run when it switches: their values are there after."""
    x = torch.randn(16, 16)
    with torch_pjrt.mode("fused"):
        t = x.to("tpu")
        with torch_pjrt.thread_mode("fused"):
            y = (t @ t).tanh()
        with torch_pjrt.thread_mode("strict"):
            z = y + 1  # reads the value the fused graph gives y
        torch.testing.assert_close(z.cpu(), (x @ x).tanh() + 1)


@pytest.mark.parametrize("process", ["strict", "fused"])
def test_compiled_calls_and_eager_threads_on_one_device_match_cpu(process):
    """Thread A runs a compiled training step over and over while thread B runs eager ops on the same device:
    the compiled call's fused scope never leaks into B, and both give the CPU's numbers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to("tpu")
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4, 8, generator=g) for _ in range(6)]

    def loss_of(m, x):
        return m(x).square().mean()

    compiled = torch.compile(loss_of, backend="tpu")
    with torch_pjrt.mode(process):
        def compiled_steps():
            out = []
            for x in xs:
                model.zero_grad()
                loss = compiled(model, x.to("tpu"))
                loss.backward()
                out.append((loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]))
            return out

        def eager_steps():
            return [_work(10 + i) for i in range(6)]

        errors, results = [], {}

        def run(name, fn):
            try:
                results[name] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=("compiled", compiled_steps), daemon=True),
                   threading.Thread(target=run, args=("eager", eager_steps), daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
            assert not t.is_alive(), "a thread did not finish: deadlock?"
        if errors:
            raise errors[0]
        assert torch_pjrt.get_mode() == process
    for x, (loss, grads) in zip(xs, results["compiled"]):
        ref.zero_grad()
        want = loss_of(ref, x)
        want.backward()
        torch.testing.assert_close(loss, want.detach())
        for got, p in zip(grads, ref.parameters()):
            torch.testing.assert_close(got, p.grad)
    for got, want in results["eager"]:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("process", ["fused", "strict"])
def test_capture_refuses_a_thread_mode_that_does_not_record(process):
    with torch_pjrt.mode(process), torch_pjrt.thread_mode("strict"):
        graph = torch.accelerator.Graph()
        with pytest.raises(RuntimeError, match="mode of its own"):
            with graph:
                torch.ones(2, device="tpu")
        assert torch_pjrt.get_mode() == "strict"
        assert torch_pjrt._C._get_process_mode() == process  # the refused capture switched nothing
