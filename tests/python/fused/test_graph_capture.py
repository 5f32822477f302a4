"""torch.accelerator.Graph on tpu: a captured step replays as one program, against CPU PyTorch.

The CPU has no graphs: the reference for a replay is running the captured
code again eagerly on the CPU, as CUDA graphs' semantics define it.
"""

import pytest
import torch
import torch.nn.functional as F

import torch_pjrt


def _model(device, capturable):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=capturable)
    return model, opt


def _batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(n)]


def _cpu_losses(batches):
    model, opt = _model("cpu", capturable=False)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def _executions():
    return torch_pjrt.metrics()["executions"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_captured_training_step_matches_cpu(compiled):
    batches = _batches()
    ref_losses, ref_model = _cpu_losses(batches)
    torch._dynamo.reset()
    model, opt = _model("tpu", capturable=True)
    loss_of = lambda x, y: F.cross_entropy(model(x), y)  # noqa: E731
    opt_step = opt.step
    if compiled:
        loss_of, opt_step = torch.compile(loss_of, backend="tpu"), torch.compile(opt.step, backend="tpu")
    static_x = torch.zeros(5, 8, device="tpu")
    static_y = torch.zeros(5, dtype=torch.long, device="tpu")

    def step():
        opt.zero_grad()
        loss = loss_of(static_x, static_y)
        loss.backward()
        opt_step()
        return loss

    static_x.copy_(batches[0][0])
    static_y.copy_(batches[0][1])
    losses = [step().item()]  # a warm-up step outside the capture, as on CUDA
    before = [p.detach().cpu() for p in model.parameters()]
    graph = torch.accelerator.Graph()
    with graph:
        static_loss = step()
    # Capturing runs nothing: the parameters are still the warm-up step's.
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p.detach().cpu(), q)
    start = _executions()
    for x, y in batches[1:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        losses.append(static_loss.item())
    assert (_executions() - start) / (len(batches) - 1) == pytest.approx(1.0, abs=0.5)  # one program per replay (+ the input copies)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5)


def test_one_program_per_replay():
    x = torch.randn(4, 4, device="tpu")
    acc = torch.zeros(4, 4, device="tpu")
    graph = torch.accelerator.Graph()
    with graph:
        acc.add_(x.sin() * 2)
        acc.mul_(0.5)
    start = _executions()
    for _ in range(3):
        graph.replay()
    assert _executions() - start == 3
    ref = torch.zeros(4, 4)
    for _ in range(3):
        ref.add_(x.cpu().sin() * 2).mul_(0.5)
    torch.testing.assert_close(acc.cpu(), ref)


def test_inference_capture_under_no_grad():
    # A module call under no_grad ends with a cut point (fused mode's end of
    # inference): a capture skips it instead of running the ops.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
    x = torch.randn(3, 6)
    tpu_model = model.to("tpu") if False else torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()).to("tpu")
    tpu_model.load_state_dict(model.state_dict())
    static_x = x.to("tpu")
    graph = torch.accelerator.Graph()
    with torch.no_grad(), graph:
        out = tpu_model(static_x)
    for k in range(3):
        new = torch.randn(3, 6) * (k + 1)
        static_x.copy_(new)
        graph.replay()
        with torch.no_grad():
            torch.testing.assert_close(out.cpu(), model(new))


def test_random_ops_draw_fresh_numbers_per_replay():
    x = torch.ones(1000, device="tpu")
    graph = torch.accelerator.Graph()
    with graph:
        y = F.dropout(x, p=0.5, training=True)
    graph.replay()
    first = y.cpu()
    graph.replay()
    second = y.cpu()
    for v in (first, second):
        assert set(v.unique().tolist()) <= {0.0, 2.0}
        assert 350 < int((v == 0).sum()) < 650
    assert not torch.equal(first, second)


def test_reading_a_value_inside_a_capture_raises_and_discards_it():
    x = torch.randn(3, device="tpu")
    mode_before = torch_pjrt.get_mode()
    graph = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="capturing a graph"):
        with graph:
            y = x * 2
            y.sum().item()
    # The device records and runs again, in the user's mode.
    assert torch_pjrt.get_mode() == mode_before
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)
    with pytest.raises(RuntimeError, match="graph capture that failed"):
        y.cpu()


def test_tensor_made_in_capture_has_no_value_before_replay():
    x = torch.randn(3, device="tpu")
    graph = torch.accelerator.Graph()
    with graph:
        y = x + 1
    with pytest.raises(RuntimeError, match="first replay"):
        y.cpu()
    graph.replay()
    torch.testing.assert_close(y.cpu(), x.cpu() + 1)


def test_non_capturable_optimizer_raises():
    model, opt = _model("tpu", capturable=False)
    loss = model(torch.randn(2, 8, device="tpu")).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="capturable is False"):
        with torch.accelerator.Graph():
            opt.step()


def test_cpu_tensor_operand_cannot_be_captured():
    x = torch.randn(3, 3, device="tpu")
    with pytest.raises(RuntimeError, match="CPU tensor"):
        with torch.accelerator.Graph():
            y = x[torch.tensor([0, 2])]  # noqa: F841 - a CPU index tensor: its later values are not seen


def test_replay_and_reset_errors():
    graph = torch.accelerator.Graph()
    with pytest.raises(RuntimeError, match="nothing was captured"):
        graph.replay()
    x = torch.zeros(2, device="tpu")
    with graph:
        x.add_(1)
    graph.replay()
    graph.reset()
    with pytest.raises(RuntimeError, match="nothing was captured"):
        graph.replay()
    torch.testing.assert_close(x.cpu(), torch.ones(2))


def test_debug_dump_writes_the_program(tmp_path):
    graph = torch.accelerator.Graph()
    graph.enable_debug_mode()
    x = torch.randn(4, device="tpu")
    with graph:
        y = x.exp()  # noqa: F841
    path = tmp_path / "graph.mlir"
    graph.debug_dump(str(path))
    text = path.read_text()
    assert "func.func" in text and "exponential" in text


def test_host_allocator_calls():
    torch.randn(2, device="tpu").cpu()
    torch.accelerator.empty_host_cache()  # no cache to empty; must not crash
    pinned = torch.randn(4).pin_memory()
    torch.testing.assert_close(pinned.to("tpu").cpu(), pinned)


def test_reading_a_value_written_before_the_capture_raises():
    # Not pending, so readable without running anything, but the value would
    # be fixed in every replay: a read is refused as on CUDA.
    pos = torch.tensor([5], device="tpu")
    with pytest.raises(RuntimeError, match="fixed in every replay"):
        with torch.accelerator.Graph():
            int(pos.item())
    with pytest.raises(RuntimeError, match="capturing a graph"):
        with torch.accelerator.Graph():
            torch.tensor([1.0, 2.0]).to("tpu")  # a host copy: a replay would not copy again
    torch.testing.assert_close(pos.cpu(), torch.tensor([5]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_captured_static_cache_decode_step_matches_cpu(kind, compiled):
    # CUDA graphs' use in generation: one decode step with transformers'
    # StaticCache captured, then replayed per token with the new token and
    # position copied into the captured inputs.
    pytest.importorskip("transformers")
    import copy

    from conftest import tiny_model
    from transformers import StaticCache

    torch._dynamo.reset()
    model = tiny_model(kind)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    new_tokens = 6

    def decode(m, device, capture):
        cache = StaticCache(config=m.config, max_cache_len=16)
        step = torch.compile(m, backend="tpu") if capture and compiled else m
        logits = []
        with torch.no_grad():
            out = m(ids.to(device), past_key_values=cache, cache_position=torch.arange(5, device=device), use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            pos = torch.tensor([5], device=device)
            if capture:
                graph = torch.accelerator.Graph()
                with graph:
                    captured = step(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]
            for _ in range(new_tokens):
                if capture:
                    graph.replay()
                    last = captured
                else:
                    last = m(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]
                logits.append(last.cpu())
                tok.copy_(last.argmax(-1, keepdim=True))
                pos.add_(1)
        return torch.stack(logits)

    expected = decode(copy.deepcopy(model), "cpu", False)
    start = torch_pjrt.metrics()["graph_replays"]
    got = decode(model.to("tpu"), "tpu", True)
    assert torch_pjrt.metrics()["graph_replays"] - start == new_tokens
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ---- what a replay could otherwise get silently wrong (each raises or matches the CPU) ----

def test_switching_mode_inside_a_capture_raises():
    acc = torch.zeros(3, device="tpu")
    other = "strict" if torch_pjrt.get_mode() != "strict" else "debug"
    with pytest.raises(RuntimeError, match="while tpu:0 is capturing"):
        with torch.accelerator.Graph():
            with torch_pjrt.mode(other):
                acc.add_(1)
    torch.testing.assert_close(acc.cpu(), torch.zeros(3))


def test_cpu_scalar_tensor_is_not_fixed_into_replays():
    # A 0-d CPU tensor (an LR a scheduler changes) is state, not a number: refused.
    x = torch.ones(3, device="tpu")
    scale = torch.tensor(2.0)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        with torch.accelerator.Graph():
            y = x * scale  # noqa: F841
    # A Python number is fixed, as on CUDA.
    graph = torch.accelerator.Graph()
    with graph:
        y = x * 2.0
    graph.replay()
    torch.testing.assert_close(y.cpu(), torch.full((3,), 2.0))


def test_checkpointed_dropout_recomputes_the_forward_mask_in_replays():
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(256, device="tpu", requires_grad=True)

    def step():
        x.grad = None
        y = checkpoint(lambda t: F.dropout(t, 0.5, True), x, use_reentrant=False)
        (y * 3).sum().backward()
        return y

    step()
    graph = torch.accelerator.Graph()
    with graph:
        y = step()
    masks = []
    for _ in range(3):
        graph.replay()
        kept = y.detach().cpu() != 0
        # Reference: dropout's gradient is the forward's mask times 3 * 2 (CPU semantics of checkpoint).
        torch.testing.assert_close(x.grad.cpu(), kept.float() * 6.0)
        masks.append(kept)
    assert not torch.equal(masks[0], masks[1])


def test_reseeding_inside_a_capture_raises():
    z = torch.ones(64, device="tpu")
    with pytest.raises(RuntimeError, match="reseeded"):
        with torch.accelerator.Graph():
            torch.manual_seed(0)
            F.dropout(z, 0.5, True)


def test_optimizer_with_host_step_counts_raises():
    w = torch.nn.Parameter(torch.ones(4, device="tpu"))
    opt = torch.optim.Adagrad([w], lr=0.1, lr_decay=0.5)  # no capturable option: CPU step counts
    w.grad = torch.ones(4, device="tpu")
    opt.step()
    with pytest.raises(RuntimeError, match="step count on the host"):
        with torch.accelerator.Graph():
            opt.step()


def test_compiled_graph_with_cpu_inputs_raises():
    torch._dynamo.reset()
    w = torch.nn.Parameter(torch.ones(4, device="tpu"))
    opt = torch.optim.Adam([w], lr=0.1, capturable=False)
    w.grad = torch.ones(4, device="tpu")
    step = torch.compile(opt.step, backend="tpu")
    step()
    with pytest.raises(RuntimeError, match="CPU tensor inputs|capturable is False"):
        with torch.accelerator.Graph():
            step()


def test_debug_dump_needs_debug_mode_first():
    graph = torch.accelerator.Graph()
    x = torch.randn(2, device="tpu")
    with graph:
        y = x + 1  # noqa: F841
    with pytest.raises(RuntimeError, match="enable_debug_mode"):
        graph.debug_dump("/dev/null")
