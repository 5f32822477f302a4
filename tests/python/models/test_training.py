"""End to end: an MLP and a small CNN train 20 AdamW steps on tpu and on CPU from
the same seed; the loss curves agree to float32 tolerance."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(16, 10))


def train(make, input_shape, device, steps=20):
    torch.manual_seed(0)
    model = make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, *input_shape, generator=gen).to(device)
    y = torch.randint(0, 10, (16,), generator=gen).to(device)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("make,shape", [(mlp, (32,)), (cnn, (3, 8, 8))], ids=["mlp", "cnn"])
def test_training_matches_cpu(make, shape):
    torch_pjrt.reset_metrics()
    cpu_losses, cpu_model = train(make, shape, "cpu")
    tpu_losses, tpu_model = train(make, shape, "tpu")
    assert tpu_losses[-1] < tpu_losses[0] * 0.9, "the model did not learn"
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), atol=2e-4, rtol=2e-4)
    for (name, p_cpu), p_tpu in zip(cpu_model.state_dict().items(), tpu_model.state_dict().values()):
        torch.testing.assert_close(p_tpu.cpu(), p_cpu, atol=2e-4, rtol=2e-3, msg=name)
    assert not torch_pjrt.metrics()["cpu_fallbacks"], torch_pjrt.metrics()["cpu_fallbacks"]
