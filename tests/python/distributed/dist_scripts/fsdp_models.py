"""Small models and the single-process CPU reference for the FSDP2/DTensor tests.

Plain torch only: the reference runs on the CPU without torch_pjrt.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HIDDEN, HEADS, SEQ = 16, 32, 4, 6
STEPS, LR = 10, 1e-2


class Block(nn.Module):
    """Pre-norm residual MLP block (the transformer's feed-forward half)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Attention(nn.Module):
    """Causal multi-head self-attention; the local head count follows q's width (tensor parallel)."""

    def __init__(self):
        super().__init__()
        # No q/k/v biases (as Llama): a key bias shifts every score of a query
        # alike, so its gradient is pure rounding noise, which Adam amplifies.
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        hd = DIM // HEADS
        q, k, v = (proj(x).view(b, t, -1, hd).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) / hd ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        return x + self.out(att.transpose(1, 2).reshape(b, t, -1))


class Net(nn.Module):
    """Transformer-ish stack: blocks (optionally with attention) then a linear head."""

    def __init__(self, n_blocks=2, attention=False):
        super().__init__()
        layers = []
        for _ in range(n_blocks):
            if attention:
                layers.append(Attention())
            layers.append(Block())
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).squeeze(-1)


def make(kind):
    return Net(attention=(kind == "attn"))


def initial_state(kind):
    torch.manual_seed(0)
    return {k: v.clone() for k, v in make(kind).state_dict().items()}


def batches(kind, global_batch):
    """STEPS (input, target) pairs of the global batch, on the CPU."""
    g = torch.Generator().manual_seed(1)
    shape = (global_batch, SEQ, DIM) if kind == "attn" else (global_batch, DIM)
    return [(torch.randn(shape, generator=g), torch.randn(shape[:-1], generator=g)) for _ in range(STEPS)]


def loss_fn(out, target):
    return F.mse_loss(out, target)


def optimizer(params):
    # eps 1e-6, not 1e-8: Adam divides a gradient entry by its own size, so a
    # cancellation-sized entry would become an lr-sized update that depends on
    # the summation order (sharded vs. whole).
    return torch.optim.AdamW(params, lr=LR, eps=1e-6, foreach=False)


def reference(kind, global_batch):
    """Losses and final parameters of STEPS AdamW steps on the CPU over the global batch."""
    model = make(kind)
    model.load_state_dict(initial_state(kind))
    opt = optimizer(model.parameters())
    losses = []
    for x, y in batches(kind, global_batch):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
