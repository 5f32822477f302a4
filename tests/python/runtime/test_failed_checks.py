"""A step whose runtime check fails (a bad index in the batch) changes nothing.

The check's error (the CPU's IndexError, say) is raised at the next host wait,
after the optimizer step that followed the bad op was recorded or run. Every
tensor that step writes (parameters, optimizer state, the step count, on the
device or on the host) keeps its value, so a user who catches the error and
skips the batch trains on exactly as a CPU run that skipped it.
"""
import inspect

import pytest
import torch
import torch.nn as nn

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

VOCAB, CLASSES = 11, 3


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, tokens, targets):
        logits = self.out(torch.tanh(self.emb(tokens)).mean(1))
        return -logits.log_softmax(-1).gather(1, targets[:, None]).mean()  # a gather index: the targets


def make_model():
    torch.manual_seed(0)
    return Model()


def batch(seed, bad=None):
    g = torch.Generator().manual_seed(seed)
    tokens, targets = torch.randint(0, VOCAB, (4, 5), generator=g), torch.randint(0, CLASSES, (4,), generator=g)
    if bad == "embedding":
        tokens[2, 3] = VOCAB
    elif bad == "gather":
        targets[1] = CLASSES
    return tokens, targets


def record_step(model, opt, tokens, targets, mode):
    opt.zero_grad()
    loss = model(tokens, targets)
    loss.backward()
    if mode == "lazy":
        torch_pjrt.optimizer_step(opt)
    else:
        opt.step()  # fused mode runs the step's graph here
    return loss


def snapshot(model, opt):
    params = list(model.parameters())
    out = {f"param{i}": p.detach().cpu().clone() for i, p in enumerate(params)}
    for i, p in enumerate(params):
        out.update({f"{i}.{k}": v.detach().cpu().clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
    return out


def assert_same_state(got, expected):
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k].to(got[k].dtype), rtol=1e-4, atol=1e-6, msg=k)


def cpu_error(bad):
    model = make_model()
    with pytest.raises(Exception) as info:
        model(*batch(0, bad))
    return info.type, str(info.value)


def cpu_run(batches):
    """The same training on the CPU (capturable or not: the same math) over `batches`."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens, targets in batches:
        record_step(model, opt, tokens, targets, "strict").item()
    return snapshot(model, opt)


MODES = ["fused", "strict", "lazy", "debug"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("capturable", [True, False])
@pytest.mark.parametrize("bad", ["embedding", "gather"])
def test_a_failed_check_leaves_the_step_undone(mode, capturable, bad):
    """The error is read after the optimizer step that followed the bad op: that step writes nothing."""
    error_type, error_message = cpu_error(bad)
    batches = [batch(seed) for seed in range(5)]
    batches[2] = batch(2, bad)
    with torch_pjrt.mode(mode):
        model = make_model().to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=capturable)
        for k, (tokens, targets) in enumerate(batches):
            if k != 2:
                record_step(model, opt, tokens.to("tpu"), targets.to("tpu"), mode).item()
                continue
            before = snapshot(model, opt)
            with pytest.raises(error_type) as info:
                record_step(model, opt, tokens.to("tpu"), targets.to("tpu"), mode).item()
            assert error_message in str(info.value)
            assert_same_state(snapshot(model, opt), before)  # exactly as before the failed step
        final = snapshot(model, opt)
    assert_same_state(final, cpu_run(batches[:2] + batches[3:]))


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("capturable", [True, False])
def test_steps_after_a_failed_check_write_nothing_until_its_error_is_raised(mode, capturable):
    """A loop that reads every other step: the good step after the bad one is dropped too, then training goes on."""
    batches = [batch(seed) for seed in range(7)]
    batches[2] = batch(2, "embedding")
    with torch_pjrt.mode(mode):
        model = make_model().to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=capturable)
        raised = []
        for k in range(0, len(batches), 2):
            losses = [record_step(model, opt, t.to("tpu"), y.to("tpu"), mode) for t, y in batches[k:k + 2]]
            try:
                torch.tpu.synchronize(); line = inspect.currentframe().f_lineno  # noqa: E702
            except IndexError as e:
                raised.append((k, str(e)))
            else:
                [loss.item() for loss in losses]
        assert [k for k, _ in raised] == [2]
        assert "index out of range in self" in raised[0][1]
        assert f"{__file__}:" in raised[0][1] and f":{line}" not in raised[0][1]  # names the model's line
        final = snapshot(model, opt)
    assert_same_state(final, cpu_run(batches[:2] + batches[4:]))


def test_an_in_place_update_in_the_failed_graph_is_kept_out():
    """Inside one fused graph: a tensor updated after the bad op keeps its value; a new one is computed."""
    cpu = torch.randn(VOCAB, 4)
    with torch_pjrt.mode("fused"):
        w = cpu.to("tpu")
        torch_pjrt.sync()
        rows = w[torch.tensor([1, VOCAB], device="tpu")]
        w.mul_(2)
        fresh = torch.ones(3, device="tpu") * 3
        with pytest.raises(IndexError):
            torch.tpu.synchronize()
        torch.testing.assert_close(w.cpu(), cpu, rtol=0, atol=0)
        torch.testing.assert_close(fresh.cpu(), torch.full((3,), 3.0))
        del rows
        w.mul_(2)  # the device goes on
        torch.testing.assert_close(w.cpu(), cpu * 2, rtol=0, atol=0)


def _status_reads():
    return torch_pjrt.metrics()["check_status_reads"]


@pytest.mark.parametrize("capturable", [True, False])
def test_a_loop_that_never_reads_waits_for_no_status(capturable):
    """Fused programs chain the unread statuses on the device: no step waits for the one before to keep values."""
    batches = [batch(seed) for seed in range(6)]
    with torch_pjrt.mode("fused"):
        model = make_model().to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=capturable)
        record_step(model, opt, *[t.to("tpu") for t in batches[0]], "fused").item()
        before = _status_reads()
        for tokens, targets in batches[1:]:
            record_step(model, opt, tokens.to("tpu"), targets.to("tpu"), "fused")
        assert _status_reads() == before  # nothing read the statuses: no step waited
        torch.tpu.synchronize()
        assert _status_reads() > before
        final = snapshot(model, opt)
    assert_same_state(final, cpu_run(batches))


@pytest.mark.parametrize("compiled", [False, True], ids=["recorded", "compiled"])
def test_a_failure_keeps_values_through_later_unread_steps(compiled):
    """Two good steps after the bad one, nothing read: each chains the one before (the second through a status
    that only says an earlier program failed), all three write nothing, the error is raised once."""
    batches = [batch(seed) for seed in range(7)]
    batches[2] = batch(2, "embedding")
    torch._dynamo.reset()
    with torch_pjrt.mode("fused"):
        model = make_model().to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        loss_of = torch.compile(model, backend="tpu") if compiled else model

        def step(tokens, targets):
            opt.zero_grad()
            loss = loss_of(tokens.to("tpu"), targets.to("tpu"))
            loss.backward()
            opt.step()
            return loss

        for tokens, targets in batches[:2]:
            step(tokens, targets).item()
        before, reads = snapshot(model, opt), _status_reads()
        for tokens, targets in batches[2:5]:
            step(tokens, targets)
        assert _status_reads() == reads
        with pytest.raises(IndexError, match="index out of range in self"):
            torch.tpu.synchronize()
        torch.tpu.synchronize()  # raised once
        assert_same_state(snapshot(model, opt), before)
        for tokens, targets in batches[5:]:
            step(tokens, targets).item()
        final = snapshot(model, opt)
    assert_same_state(final, cpu_run(batches[:2] + batches[5:]))


def test_a_captured_step_replayed_after_a_failed_replay_writes_nothing():
    """torch.accelerator.Graph: the replay after a failed one chains its status on the device."""
    error_type, error_message = cpu_error("gather")
    batches = [batch(seed) for seed in range(6)]
    batches[2] = batch(2, "gather")
    with torch_pjrt.mode("fused"):
        model = make_model().to("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
        static_tokens = torch.zeros(4, 5, dtype=torch.long, device="tpu")
        static_targets = torch.zeros(4, dtype=torch.long, device="tpu")

        def load(k):
            static_tokens.copy_(batches[k][0])
            static_targets.copy_(batches[k][1])

        load(0)
        record_step(model, opt, static_tokens, static_targets, "fused").item()  # warm-up, outside the capture
        graph = torch.accelerator.Graph()
        with graph:
            static_loss = record_step(model, opt, static_tokens, static_targets, "fused")
        load(1)
        graph.replay()
        static_loss.item()
        before = snapshot(model, opt)
        for k in (2, 3):
            load(k)
            graph.replay()
        with pytest.raises(error_type, match=error_message):
            torch.tpu.synchronize()
        assert_same_state(snapshot(model, opt), before)
        for k in (4, 5):
            load(k)
            graph.replay()
            static_loss.item()
        final = snapshot(model, opt)
    assert_same_state(final, cpu_run(batches[:2] + batches[4:]))


# ---- host state beyond the optimizer: GradScaler stages, LR schedulers ----

def scaled_run(device, batches, skip, unscale_first, read_every=1):
    """An SGD loop with a GradScaler and a StepLR: the documented recipe, the error caught and the batch skipped.

    On the CPU the bad batch raises in its forward (`skip` it there); on tpu the error surfaces at the next read
    (found-inf in scaler.step(), or a loss read `read_every` steps later)."""
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 10)
    losses, raised = [], []
    for k, (tokens, targets) in enumerate(batches):
        if k in skip:
            continue
        try:
            loss = model(tokens.to(device), targets.to(device))
            scaler.scale(loss).backward()
            if unscale_first:  # as before clipping: the stage changes before step()
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad()
            if (k + 1) % read_every == 0:
                losses.append(loss.item())
        except IndexError:
            raised.append(k)
            opt.zero_grad()
    state = {"lr": opt.param_groups[0]["lr"], "last_epoch": sched.last_epoch, "scale": scaler.get_scale(),
             "stages": [s["stage"] for s in scaler._per_optimizer_states.values()]}
    params = [p.detach().cpu() for p in model.parameters()]
    return losses, raised, state, params


@pytest.mark.parametrize("mode", ["fused", "strict"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_a_grad_scaler_loop_that_skips_a_bad_batch_goes_on_as_the_cpu(mode, unscale_first):
    """The IndexError surfaces inside scaler.step() (its found-inf read) after unscale_ changed the stage: the
    scaler must not keep that stage, or the next step applies gradients still multiplied by the scale."""
    batches = [batch(seed) for seed in range(6)]
    batches[2] = batch(2, "embedding")
    cpu_losses, _, cpu_state, cpu_params = scaled_run("cpu", batches, {2}, unscale_first)
    with torch_pjrt.mode(mode):
        losses, raised, state, params = scaled_run("tpu", batches, set(), unscale_first)
    assert raised == [2]
    assert state == cpu_state
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-5)
    for got, expected in zip(params, cpu_params):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_schedulers_and_scalers_come_back_when_the_error_is_read_steps_later(mode):
    """Read every 2 steps: the bad step 2 and the good step 3 write nothing on the device, and the scheduler's
    count, the learning rate and the optimizer's step count go back to before step 2, as on a CPU run that
    skipped both batches."""
    batches = [batch(seed) for seed in range(8)]
    batches[2] = batch(2, "embedding")

    def run(device, skip):
        model = make_model().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # capturable=False: a CPU step count
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        raised = []
        for k in range(0, len(batches), 2):
            try:
                losses = []
                for j in (k, k + 1):
                    if j not in skip:
                        losses.append(record_step(model, opt, *[t.to(device) for t in batches[j]], "strict"))
                        sched.step()
                [loss.item() for loss in losses]
            except IndexError:
                raised.append(k)
        step = opt.state[next(model.parameters())]["step"]
        return raised, (sched.last_epoch, opt.param_groups[0]["lr"], step.item()), snapshot(model, opt)

    _, cpu_counts, cpu_state = run("cpu", {2, 3})
    with torch_pjrt.mode(mode):
        raised, counts, state = run("tpu", set())
    assert raised == [2]
    assert counts == cpu_counts
    assert_same_state(state, cpu_state)
