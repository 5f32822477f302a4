"""Fused and lazy modes: graphs instead of single ops, same numbers as strict."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt


def train(mode, steps=4, dropout=0.2):
    with torch_pjrt.mode(mode):
        torch.manual_seed(0)
        torch.tpu.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 4)).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(8, 16).to("tpu")
        y = torch.randint(0, 4, (8,)).to("tpu")
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        weights = [p.detach().cpu() for p in model.parameters()]
    return losses, weights


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_same_numbers_as_strict_including_dropout(mode):
    strict_losses, strict_weights = train("strict")
    losses, weights = train(mode)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(strict_losses), rtol=1e-6, atol=1e-6)
    for a, b in zip(weights, strict_weights):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_training_step_is_one_graph_found_by_structure():
    train("fused", steps=2)  # warm up every shape
    torch_pjrt.reset_metrics()
    train("fused", steps=5)
    m = torch_pjrt.metrics()
    assert m["compiles"] == 0, "a steady loop must not compile"
    assert m["fused_ops"] > 20 * m["graphs"] / 2  # many ops per graph
    assert m["graph_cache_hits"] == m["graphs"]


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_lazy_runs_nothing_until_sync():
    with torch_pjrt.mode("lazy"):
        torch_pjrt.reset_metrics()
        a = torch.randn(64, 64).to("tpu")
        w = torch.randn(64, 64).to("tpu", non_blocking=True)
        for _ in range(5):
            a = torch.tanh(a @ w)
        assert torch_pjrt.metrics()["executions"] == 0
        torch_pjrt.sync()
        assert torch_pjrt.metrics()["graphs"] == 1
        expected = torch.randn(1)  # keep CPU RNG use symmetric; value unused
        out = a.cpu()
    ref_a = a  # the tensor keeps its value after the graph ran
    torch.testing.assert_close(ref_a.cpu(), out)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_lazy_optimizer_step_syncs():
    with torch_pjrt.mode("lazy"):
        p = torch.nn.Parameter(torch.ones(4, device="tpu"))
        opt = torch.optim.SGD([p], lr=0.5)
        p.grad = torch.full((4,), 2.0, device="tpu")
        torch_pjrt.reset_metrics()
        torch_pjrt.optimizer_step(opt)
        assert torch_pjrt.metrics()["graphs"] == 1
    torch.testing.assert_close(p.detach().cpu(), torch.zeros(4))


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_fallback_and_views_inside_a_graph():
    with torch_pjrt.mode("fused"):
        x = torch.arange(12.0).reshape(3, 4)
        t = x.to("tpu")
        t[:, 1] += 10
        u = torch.unique(t.flatten() % 5)  # CPU fallback: the graph runs first
        t.t()[2].mul_(2)
        x[:, 1] += 10
        x.t()[2].mul_(2)
        torch.testing.assert_close(u.cpu(), torch.unique(x.flatten() % 5))
        torch.testing.assert_close(t.cpu(), x)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_dead_intermediates_do_not_keep_buffers():
    with torch_pjrt.mode("fused"):
        a = torch.randn(256, 256, device="tpu")
        torch_pjrt.sync()
        before = torch.tpu.memory_allocated()
        b = a
        for _ in range(10):
            b = b * 1.01  # nine dead intermediates
        torch_pjrt.sync()
        after = torch.tpu.memory_allocated()
    assert after - before == 256 * 256 * 4  # only the live result remains


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_graph_size_limit_and_mode_switch_flush():
    with torch_pjrt.mode("fused"):
        a = torch.zeros(4, device="tpu")
        for _ in range(50):
            a = a + 1
    # Leaving fused mode ran the pending graph.
    assert torch_pjrt.metrics()["graphs"] >= 1
    torch.testing.assert_close(a.cpu(), torch.full((4,), 50.0))


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_recompile_explainer_names_what_changed():
    def run(n):
        a = torch.ones(n, 3, device="tpu")
        return (a * 2 + 1).sum().item()

    with torch_pjrt.mode("fused"):
        run(4)
        torch_pjrt.reset_metrics()
        run(5)
    reasons = torch_pjrt.metrics()["recompile_reasons"]
    assert reasons, "a new shape must be explained"
    assert "[5, 3]" in reasons[-1] and "[4, 3]" in reasons[-1]
    assert "recompiled" in torch_pjrt.metrics_report()


def buffer_address(t):
    """The plugin's address of the buffer behind `t`'s storage (runs pending graphs)."""
    return torch_pjrt._C._storage_buffer_address(t)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_in_place_updates_donate_their_buffers(mode):
    with torch_pjrt.mode(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(8, 16).to("tpu")

        def step():
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()
            torch_pjrt.sync()

        step()  # creates the optimizer state
        state = [t for s in opt.state.values() for t in s.values() if t.device.type == "tpu"]
        tensors = list(model.parameters()) + state
        before = [buffer_address(t) for t in tensors]
        torch_pjrt.reset_metrics()
        step()
        step()
        m = torch_pjrt.metrics()
        # Parameters and both Adam moments are updated in place: each keeps its buffer.
        assert [buffer_address(t) for t in tensors] == before
        assert m["donated_buffers"] >= 2 * len(tensors)
        assert m["donated_bytes"] >= 2 * sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_donation_keeps_values_read_before_the_update():
    cpu = torch.randn(100)
    with torch_pjrt.mode("fused"):
        p = cpu.to("tpu")
        torch_pjrt.sync()
        torch_pjrt.reset_metrics()
        old = p.clone()          # a copy taken before the update, in the same graph
        doubled = p * 2
        p[10:20].add_(1)         # a partial in-place write through a view
        p.mul_(3)
        torch_pjrt.sync()
        expected = cpu.clone()
        expected[10:20] += 1
        expected *= 3
        torch.testing.assert_close(p.cpu(), expected)
        torch.testing.assert_close(old.cpu(), cpu)
        torch.testing.assert_close(doubled.cpu(), cpu * 2)
        assert torch_pjrt.metrics()["donated_buffers"] >= 1


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_strict_mode_gives_in_place_results_new_buffers():
    # The reference for the donation test above: strict mode runs one program
    # per op, without donation, so the buffer behind an updated tensor moves.
    with torch_pjrt.mode("strict"):
        p = torch.randn(1000).to("tpu")
        before = buffer_address(p)
        keep = torch.ones(1000).to("tpu")  # keeps the old address from being recycled at once
        p.add_(keep)
        assert buffer_address(p) != before


@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_graph_error_names_the_line_that_recorded_the_failing_op(mode):
    import inspect
    import re

    cpu = torch.randn(10)
    torch_pjrt._C._inject_compile_fault("aten::tanh")
    try:
        with torch_pjrt.mode(mode):
            x = cpu.to("tpu")
            y = x * 2 + 1
            z = torch.tanh(y); tanh_line = inspect.currentframe().f_lineno  # noqa: E702
            total = z.sum()
            with pytest.raises(RuntimeError) as info:
                total.item()
    finally:
        torch_pjrt._C._inject_compile_fault("")
    message = str(info.value)
    assert f"{__file__}:{tanh_line} in test_graph_error_names" in message
    assert re.search(r"failed at op \d+, aten::tanh\(Float\[10\]\)", message)
    assert "torch_pjrt_injected_fault" in message  # the plugin's own error is kept
    # What the failed graph was to compute raises instead of reading as zeros;
    # its inputs keep their values.
    with pytest.raises(RuntimeError, match="this tpu tensor has no value: a fused graph"):
        z.cpu()
    with pytest.raises(RuntimeError, match="has no value"):
        (y + 1).cpu()
    torch.testing.assert_close(x.cpu(), cpu)
    y.copy_(cpu)  # assigning a value makes the tensor usable again
    torch.testing.assert_close((y + 1).cpu(), cpu + 1)
    # The failed graph left nothing behind: the same code now runs and is right.
    with torch_pjrt.mode(mode):
        z = torch.tanh(cpu.to("tpu") * 2 + 1)
        torch.testing.assert_close(z.cpu(), torch.tanh(cpu * 2 + 1))


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_fused_mode_cuts_graphs_at_optimizer_steps(mode):
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    with torch_pjrt.mode(mode):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to("tpu")
        model.load_state_dict(cpu_model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        xt = x.to("tpu")
        torch_pjrt.sync()
        torch_pjrt.reset_metrics()
        for _ in range(6):  # nothing is read inside the loop
            opt.zero_grad()
            model(xt).square().mean().backward()
            opt.step()
        weights = [p.cpu() for p in model.parameters()]
        m = torch_pjrt.metrics()
    # fused: one graph per step, and steps after the first share one program;
    # lazy: torch_xla style, everything runs at the read.
    assert m["graphs"] == (6 if mode == "fused" else 1)
    if mode == "fused":
        assert m["graph_cache_hits"] >= 4
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(6):
        cpu_opt.zero_grad()
        cpu_model(x).square().mean().backward()
        cpu_opt.step()
    for got, want in zip(weights, cpu_model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
def test_fused_inference_loop_is_one_repeating_graph_per_batch():
    # No optimizer step cuts an evaluation loop: fused mode cuts when the
    # outermost module call returns under no_grad, so the loop compiles a few
    # small graphs instead of cutting at arbitrary points of the op limit.
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    xs, ys = torch.randn(3, 8, 16), torch.randint(0, 4, (3, 8))
    with torch_pjrt.mode("fused"), torch.no_grad():
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).to("tpu")
        model.load_state_dict(cpu_model.state_dict())
        xt, yt = xs.to("tpu"), ys.to("tpu")
        torch_pjrt.sync()
        totals = []
        for _ in range(2):  # the second pass must find every graph of the first
            torch_pjrt.reset_metrics()
            correct = torch.zeros((), dtype=torch.long, device="tpu")
            for i in range(12):
                correct += (model(xt[i % 3]).argmax(1) == yt[i % 3]).sum()
            totals.append(correct.item())
        m = torch_pjrt.metrics()
    want = sum(int((cpu_model(xs[i % 3]).argmax(1) == ys[i % 3]).sum()) for i in range(12))
    assert totals == [want, want]
    assert m["graphs"] >= 12 and m["compiles"] == 0


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "lazy", "strict"])
def test_out_tensor_the_op_resizes_is_lowered_at_its_new_size(mode):
    """arange(out=empty(0)) grows out's storage after the op's signature was taken (mvlgamma does this)."""
    x = torch.rand(3, dtype=torch.float64) + 5
    with torch_pjrt.mode(mode):
        before = dict(torch_pjrt.metrics()["cpu_fallbacks"])
        out = torch.empty(0, device="tpu")
        torch.arange(0, 5, out=out)
        partial = torch.zeros(2, device="tpu")
        torch.arange(1.0, 4.0, out=partial)  # grows a storage that has a value
        mv = torch.mvlgamma(x.to("tpu"), 5)
        assert out.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert partial.cpu().tolist() == [1.0, 2.0, 3.0]
        torch.testing.assert_close(mv.cpu(), torch.mvlgamma(x, 5))
        assert torch_pjrt.metrics()["cpu_fallbacks"] == before


def _addcdiv_raising_between(device):
    """An in-place op whose Scalar cannot be converted raises; the next graph reads its tensors' neighbour."""
    a = torch.arange(4.0, device=device)
    a.addcdiv_(torch.full((4,), 2.0, device=device), torch.full((4,), 4.0, device=device), value=0.5)
    a.cpu()  # the op's program is planned; its next call is recorded without planning
    b = torch.arange(4.0, device=device)
    u1, u2 = torch.full((4,), 3.0, device=device), torch.full((4,), 6.0, device=device)
    for t in (b, u1, u2):
        t.cpu()  # values, outside any pending graph
    with pytest.raises(RuntimeError, match="cannot be converted"):
        b.addcdiv_(u1, u2, value=3 + 4.5j)
    return a.cpu(), (b * 2).cpu(), (u1 + u2).cpu()


@pytest.mark.modes_inside  # picks its mode(s): once per `make test`
@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_op_raising_while_recorded_leaves_no_operands_in_the_graph(mode):
    """Recording addcdiv_ read u1 and u2 into the graph's operands before its complex value raised: the
    next graph supplied them to a program that has no parameter for them (PyTorch's test_foreach, 74
    buffers for 72). The op must leave the graph as it was, and b keeps its value, as on the CPU."""
    expected = _addcdiv_raising_between("cpu")
    with torch_pjrt.mode(mode):
        actual = _addcdiv_raising_between("tpu")
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
