"""Moving a module to tpu and back keeps its Parameter objects, as .cuda() does.

nn.Module._apply swaps data in place (`param.data = moved`) when the old and new
tensors have compatible shallow-copy types; otherwise it makes new Parameters,
which unties tied weights and orphans optimizers built before the move.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt  # noqa: F401


class TinyGPT(nn.Module):
    """Embedding, one MLP block, LayerNorm, and an output head tied to the embedding."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        h = self.wte(ids)
        h = h + self.block(h)
        return self.lm_head(self.ln(h))


def tokens(vocab=50, batch=4, length=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def train(model, opt, x, y, steps):
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_parameters_keep_identity_to_tpu_and_back():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    params = list(model.parameters())
    ref = [p.detach().clone() for p in params]
    model.to("tpu")
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(p.device.type == "tpu" and isinstance(p, nn.Parameter) for p in params)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().cpu(), r, rtol=0, atol=0)
    model.to("cpu")
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(p.device.type == "cpu" for p in params)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=0, atol=0)


def test_buffers_move_and_keep_their_values():
    # Buffers follow CUDA's rule: _apply stores the moved tensor in the module
    # (it never swaps buffers in place), so check place and values.
    model = nn.BatchNorm1d(3)
    model(torch.randn(5, 3))  # non-trivial running stats
    ref = {k: v.clone() for k, v in model.named_buffers()}
    model.to("tpu")
    for k, v in model.named_buffers():
        assert v.device.type == "tpu"
        torch.testing.assert_close(v.cpu(), ref[k], rtol=0, atol=0)
    model.cpu()
    for k, v in model.named_buffers():
        assert v.device.type == "cpu"
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)


def test_grad_moves_along_with_its_parameter():
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    weight, grad = model.weight, model.weight.grad.clone()
    model.to("tpu")
    assert model.weight is weight
    assert weight.grad.device.type == "tpu"
    torch.testing.assert_close(weight.grad.cpu(), grad, rtol=0, atol=0)
    model.to("cpu")
    assert weight.grad.device.type == "cpu"
    torch.testing.assert_close(weight.grad, grad, rtol=0, atol=0)


def test_tied_weights_stay_one_tensor_on_tpu():
    model = TinyGPT().to("tpu")
    assert model.lm_head.weight is model.wte.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    with torch.no_grad():
        model.wte.weight[0].fill_(3.0)
    assert torch.equal(model.lm_head.weight[0].cpu(), torch.full((16,), 3.0))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_tied_model_trains_like_cpu(optimizer):
    torch.manual_seed(0)
    cpu_model = TinyGPT()
    tpu_model = copy.deepcopy(cpu_model)  # deepcopy keeps the tie
    # The optimizer is built before the move: it must still drive the moved parameters.
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    cpu_opt, tpu_opt = make(cpu_model.parameters()), make(tpu_model.parameters())
    tpu_model.to("tpu")
    x, y = tokens()
    cpu_losses = train(cpu_model, cpu_opt, x, y, steps=3)
    tpu_losses = train(tpu_model, tpu_opt, x.to("tpu"), y.to("tpu"), steps=3)
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=1e-5, atol=1e-5)
    assert tpu_model.lm_head.weight is tpu_model.wte.weight
    for (name, c), t in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(t.detach().cpu(), c.detach(), rtol=1e-4, atol=1e-5, msg=name)
    # The optimizer state lives on tpu, keyed by the same Parameter objects.
    if optimizer == "adamw":
        state = tpu_opt.state[tpu_model.wte.weight]
        assert state["exp_avg"].device.type == "tpu"
        torch.testing.assert_close(state["exp_avg"].cpu(), cpu_opt.state[cpu_model.wte.weight]["exp_avg"],
                                   rtol=1e-4, atol=1e-6)


def test_optimizer_created_before_the_move_updates_the_moved_parameters():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model.to("tpu")
    x = torch.randn(8, 4)
    for m, o, inp in [(model, opt, x.to("tpu")), (ref, ref_opt, x)]:
        for _ in range(2):
            o.zero_grad()
            m(inp).pow(2).mean().backward()
            o.step()
    assert opt.state[model.weight]["momentum_buffer"].device.type == "tpu"
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.device.type == "tpu"
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)


def test_dtype_conversions_still_work():
    model = nn.Linear(3, 2)
    weight = model.weight
    ref = model.weight.detach().clone()
    model.to("tpu")
    model.to(torch.float64)
    assert model.weight is weight and weight.dtype == torch.float64 and weight.device.type == "tpu"
    torch.testing.assert_close(weight.detach().cpu(), ref.double(), rtol=0, atol=0)
    model.half()
    assert model.weight is weight and weight.dtype == torch.float16
    torch.testing.assert_close(weight.detach().cpu(), ref.half(), rtol=0, atol=0)
    model.to("cpu", torch.float32)
    assert model.weight is weight and weight.device.type == "cpu" and weight.dtype == torch.float32
    torch.testing.assert_close(weight.detach(), ref.half().float(), rtol=0, atol=0)


def test_frozen_parameters_move():
    model = nn.Linear(3, 2)
    model.requires_grad_(False)
    weight = model.weight
    model.to("tpu")
    assert model.weight is weight and not weight.requires_grad and weight.device.type == "tpu"
    x = torch.randn(2, 3)
    torch.testing.assert_close(model(x.to("tpu")).cpu(), model.to("cpu")(x), rtol=1e-5, atol=1e-6)


def test_data_assignment_across_cpu_and_tpu():
    # The rule behind the move, used directly: as for cpu and cuda tensors.
    cpu, tpu = torch.zeros(2), torch.ones(3, device="tpu")
    assert torch._has_compatible_shallow_copy_type(cpu, tpu)
    assert torch._has_compatible_shallow_copy_type(tpu, cpu)
    p = nn.Parameter(torch.zeros(2))
    p.data = tpu
    assert p.device.type == "tpu" and p.shape == (3,)
    assert torch.equal(p.detach().cpu(), torch.ones(3))


def test_transformers_gpt2_keeps_its_tie_and_trains_like_cpu():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    cpu_model = transformers.GPT2LMHeadModel(config)
    tpu_model = copy.deepcopy(cpu_model)
    assert cpu_model.lm_head.weight is cpu_model.transformer.wte.weight
    tpu_model.to("tpu")
    assert tpu_model.lm_head.weight is tpu_model.transformer.wte.weight
    x, _ = tokens(vocab=100, batch=2, length=16)
    losses = {}
    for name, model, ids in [("cpu", cpu_model, x), ("tpu", tpu_model, x.to("tpu"))]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for _ in range(2):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    torch.testing.assert_close(torch.tensor(losses["tpu"]), torch.tensor(losses["cpu"]), rtol=1e-4, atol=1e-4)
    for (name, c), t in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(t.detach().cpu(), c.detach(), rtol=1e-4, atol=1e-5, msg=name)
