"""torch.profiler shows torch_pjrt's compiles and program runs; torch_pjrt.explain() says why things recompiled
and which user lines ran ops on the CPU."""
import inspect
import json

import torch
import torch.nn as nn

import torch_pjrt


def trace_events(tmp_path, step, record_shapes=True):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=record_shapes) as prof:
        step()
        torch.tpu.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def ours(events, kind):
    return [e for e in events if e["name"].startswith(f"torch_pjrt::{kind}(")]


def training_step(model, opt, x, y):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def test_profile_of_a_training_step_shows_compiles_and_executions(tmp_path):
    torch.manual_seed(0)
    # Sizes no other test uses: the first step compiles inside the profile.
    model = nn.Sequential(nn.Linear(11, 23), nn.ReLU(), nn.Linear(23, 3)).to("tpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(9, 11, device="tpu"), torch.randn(9, 3, device="tpu")
    torch_pjrt.reset_metrics()
    events = trace_events(tmp_path, lambda: [training_step(model, opt, x, y) for _ in range(2)])
    m = torch_pjrt.metrics()
    compiles, executions = ours(events, "compile"), ours(events, "execute")
    assert compiles and executions
    assert all(e["dur"] > 0 for e in compiles + executions)
    if torch_pjrt.get_mode() in ("fused", "lazy"):
        assert len(executions) == m["graphs"]  # one event per graph run
        assert len(compiles) == m["graphs"] - m["graph_cache_hits"]
        # The graph's ops: its name starts the list, the record's "ops" argument holds all of them.
        ops = " ".join(e["args"]["ops"] for e in executions)
        assert "aten::mm" in ops or "aten::addmm" in ops
        assert "aten::threshold_backward" in ops
        assert all(" ops: aten::" in e["name"] for e in executions)
    else:
        assert len(executions) == m["executions"]  # one event per program run
        assert len(compiles) == m["op_cache_misses"]
        names = {e["name"] for e in executions}
        assert "torch_pjrt::execute(aten::threshold_backward)" in names
        assert any("Float[9, 11]" in e["name"] and e["args"]["ops"] == e["name"][len("torch_pjrt::compile("):-1]
                   for e in compiles)
    # Each event lasts as long as its work: nested in the profiled span, never longer than it.
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    assert sum(e["dur"] for e in compiles + executions) <= span


def test_no_profiler_no_events_and_same_results():
    # Outside a profiler the scopes are inactive; results match the CPU.
    x = torch.randn(6, 5)
    torch.testing.assert_close((x.to("tpu").exp() * 3).sum(0).cpu(), (x.exp() * 3).sum(0))


def line_of(marker):
    source, start = inspect.getsourcelines(inspect.currentframe().f_back.f_code)
    for offset, text in enumerate(source):
        if marker in text:
            return start + offset
    raise AssertionError(marker)


def test_explain_names_the_shape_that_changed():
    def f(x):
        return (x * 2).sum(1)  # recompile-site

    torch_pjrt.reset_metrics()
    for rows in (13, 17):
        x = torch.randn(rows, 29)
        torch.testing.assert_close(f(x.to("tpu")).cpu(), f(x))
    explanation = torch_pjrt.explain()
    text = str(explanation)
    assert explanation.recompiles, text
    reason = next(r for r in explanation.recompiles if "Float[17, 29]" in r)
    assert "Float[13, 29]" in reason
    assert "aten::mul" in reason
    assert f"test_profiling.py:{line_of('# recompile-site')}" in reason
    if torch_pjrt.get_mode() in ("fused", "lazy"):  # a graph's explanation names the input that changed
        assert "(batch size 13 -> 17)" in reason, reason


def test_explain_names_the_cpu_fallback_op_and_line():
    # An op with neither a lowering nor a decomposition runs on the CPU.
    lowered = set(torch_pjrt.lowered_ops())
    assert "_cdist_forward" not in lowered
    torch_pjrt.reset_metrics()
    a, b = torch.randn(4, 3), torch.randn(5, 3)
    got = torch.cdist(a.to("tpu"), b.to("tpu"))  # fallback-site
    torch.testing.assert_close(got.cpu(), torch.cdist(a, b))
    fallbacks = torch_pjrt.explain().cpu_fallbacks
    (op,) = [name for name in fallbacks if "cdist" in name]
    assert fallbacks[op]["count"] >= 1
    assert f"test_profiling.py:{line_of('# fallback-site')}" in " ".join(fallbacks[op]["lines"])
    assert op in str(torch_pjrt.explain())


def test_explain_names_the_forward_line_of_a_fallback_in_backward():
    # digamma's backward runs polygamma(1, x) (on the CPU) on autograd's thread, which has no user frame:
    # it is named by the line whose op made the autograd node, marked "(backward)".
    torch_pjrt.reset_metrics()
    x = (torch.rand(4) + 1).to("tpu").requires_grad_()
    y = torch.digamma(x * 2)  # backward-fallback-site
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), 2 * torch.polygamma(1, 2 * x.detach().cpu()))
    fallbacks = torch_pjrt.explain().cpu_fallbacks
    (op,) = [name for name in fallbacks if "polygamma" in name]
    assert f"test_profiling.py:{line_of('# backward-fallback-site')} in test_explain_names_the_forward_line_of_a_" \
           f"fallback_in_backward (backward)" in " ".join(fallbacks[op]["lines"])
