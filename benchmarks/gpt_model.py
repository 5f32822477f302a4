"""The benchmarks' models: an MLP and a small GPT-style transformer, on any device.
No torch_pjrt import, so a process can run them on PyTorch's own devices alone."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, mask):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=512, width=256, layers=4, heads=4, seq=128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), 1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def mlp_setup(device):
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10)).to(device)
    return model, torch.randn(64, 256).to(device), torch.randint(0, 10, (64,)).to(device)


def gpt_setup(device):
    model = GPT().to(device)
    idx = torch.randint(0, 512, (4, 128))
    return model, idx.to(device), idx.roll(-1, 1).to(device)


def gpt_small_batch_setup(device):
    """The same GPT on one sequence of 16 tokens: per-op host cost dominates,
    as it does on a GPU or TPU, where the math of each op takes microseconds."""
    model = GPT().to(device)
    idx = torch.randint(0, 512, (1, 16))
    return model, idx.to(device), idx.roll(-1, 1).to(device)


def gpt2_small_setup(device):
    model = GPT(vocab=8192, width=768, layers=12, heads=12, seq=512).to(device)
    idx = torch.randint(0, 8192, (8, 512))
    return model, idx.to(device), idx.roll(-1, 1).to(device)


def training_step(setup, device):
    """A function running one training step (forward, cross-entropy, backward, AdamW) of the
    model `setup` builds on `device`, seeded alike everywhere; it returns the loss."""
    torch.manual_seed(0)
    model, x, y = setup(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        return loss.item()

    return step
