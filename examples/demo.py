"""torch_pjrt demo: the same training loop as on CUDA, with device="tpu".

Runs on the CPU PJRT plugin by default (TORCH_PJRT_PLUGIN=cpu|cuda|tpu|path).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_pjrt

device = "tpu"
print("platform:", torch_pjrt.platform(), "mode:", torch_pjrt.get_mode())

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Linear(8 * 14 * 14, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 10),
).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

# A synthetic, learnable task: the class is the brightest quadrant of the image.
x = torch.rand(256, 1, 28, 28)
y = x.reshape(256, 1, 2, 14, 2, 14).sum((1, 3, 5)).flatten(1).argmax(1)
x, y = x.to(device), y.to(device)

for step in range(30):
    batch = torch.randint(0, 256, (64,), device=device)
    loss = F.cross_entropy(model(x[batch]), y[batch])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 0 or step == 29:
        print(f"step {step:2d}  loss {loss.item():.4f}")

model.eval()
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"train accuracy {accuracy:.2%}")
print(torch_pjrt.metrics_report())
