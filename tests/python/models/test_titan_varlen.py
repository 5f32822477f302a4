"""TorchTitan's llama3 with varlen attention (documents packed by position, torch.nn.attention.varlen under
it) trains on tpu: its logits and gradients match the same weights with flex attention on the CPU (torch's
dense flex implementation). TorchTitan casts varlen's inputs to bf16, hence the bf16 tolerance on logits."""
import copy

import pytest
import torch

import torch_pjrt

pytest.importorskip("torchtitan", reason="torchtitan is not installed (make deps installs it)")


@pytest.fixture
def dense_cpu_flex(monkeypatch):
    import torch.nn.attention.flex_attention as flex
    from torchtitan.models.common import attention

    # CPU flex_attention refuses a backward: run torch's dense flex implementation (what runs outside Inductor).
    monkeypatch.setattr(flex, "_validate_device", lambda query, key, value: None)
    monkeypatch.setattr(attention.FlexAttention, "_compiled_flex_attn",
                        torch.compile(flex.flex_attention, backend="aot_eager"))
    monkeypatch.setattr(attention, "_compiled_create_block_mask",
                        torch.compile(flex.create_block_mask, backend="aot_eager"))


def build(backend):
    from torchtitan.models.llama3 import model_registry
    torch.manual_seed(0)
    model = model_registry("debugmodel", attn_backend=backend).model.build()
    model.init_weights()
    return model


@pytest.mark.modes_inside  # a lowering check: the mode adds nothing (the lowering tests run fused and strict)
def test_varlen_llama3_matches_flex_on_cpu(dense_cpu_flex):
    varlen, flex = build("varlen"), build("flex")
    flex.load_state_dict(varlen.state_dict())
    tokens = torch.randint(0, 2000, (2, 16), generator=torch.Generator().manual_seed(1))
    # Two documents in the second row (positions restart at 10), one in the first.
    positions = torch.cat([torch.arange(16), torch.cat([torch.arange(10), torch.arange(6)])]).reshape(2, 16)
    want = flex(tokens, attention_masks=flex.get_attention_masks(positions))
    model = copy.deepcopy(varlen).to("tpu")
    got = model(tokens.to("tpu"), attention_masks=model.get_attention_masks(positions.to("tpu")))
    torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3)
    got.square().mean().backward()
    want.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), flex.parameters()):
        scale = q.grad.abs().max().item() or 1.0
        assert (p.grad.cpu() - q.grad).abs().max().item() <= 2e-2 * scale, name
    assert "aten::_flash_attention_forward" not in torch_pjrt.metrics()["cpu_fallbacks"]
