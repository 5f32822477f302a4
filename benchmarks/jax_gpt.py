"""The GPT training step of bench_fused.py (forward, cross-entropy, backward, AdamW)
as one jax.jit program, initialised from the PyTorch model's weights: the
baseline for bench_compile_backend.py. Same math as PyTorch's modules
(LayerNorm eps 1e-5, exact GELU, causal softmax attention, AdamW with
PyTorch's defaults and weight decay 0.01, lr 1e-3).
"""
import math

import torch


def params_of(model):
    """The model's parameters as a dict of jax arrays, keyed by PyTorch's names."""
    import jax.numpy as jnp

    return {name: jnp.asarray(p.detach().cpu().numpy()) for name, p in model.named_parameters()}


def _linear(p, prefix, x):
    return x @ p[prefix + ".weight"].T + p[prefix + ".bias"]


def _layer_norm(p, prefix, x, eps=1e-5):
    import jax.numpy as jnp

    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p[prefix + ".weight"] + p[prefix + ".bias"]


def gpt_loss(p, idx, targets, layers, heads):
    import jax
    import jax.numpy as jnp

    b, t = idx.shape
    x = p["tok.weight"][idx] + p["pos.weight"][jnp.arange(t)]
    c = x.shape[-1]
    mask = jnp.triu(jnp.ones((t, t), dtype=bool), 1)
    for i in range(layers):
        pre = f"blocks.{i}."
        q, k, v = jnp.split(_linear(p, pre + "qkv", _layer_norm(p, pre + "ln1", x)), 3, axis=2)
        q, k, v = (z.reshape(b, t, heads, c // heads).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(c // heads)
        att = jax.nn.softmax(jnp.where(mask, -jnp.inf, att), axis=-1)
        x = x + _linear(p, pre + "proj", (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c))
        h = jax.nn.gelu(_linear(p, pre + "mlp.0", _layer_norm(p, pre + "ln2", x)), approximate=False)
        x = x + _linear(p, pre + "mlp.2", h)
    logits = _linear(p, "head", _layer_norm(p, "ln", x)).reshape(b * t, -1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets.reshape(-1, 1), axis=1).mean()


def make_train_step(layers=4, heads=4, **adamw):
    """jit(step)(params, m, v, count, idx, targets) -> (params, m, v, count, loss); buffers donated."""
    import jax

    return jax.jit(train_step_fn(layers, heads, **adamw), donate_argnums=(0, 1, 2, 3))


def train_step_fn(layers=4, heads=4, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """step(params, m, v, count, idx, targets) -> (params, m, v, count, loss), not jitted."""
    import jax
    import jax.numpy as jnp

    def step(p, m, v, count, idx, targets):
        loss, grads = jax.value_and_grad(gpt_loss)(p, idx, targets, layers, heads)
        count = count + 1
        b1, b2 = betas
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        c1, c2 = 1 - b1 ** count, 1 - b2 ** count

        def update(p, m, v):
            p = p * (1 - lr * weight_decay)  # decoupled weight decay, as torch.optim.AdamW
            return p - (lr / c1) * m / (jnp.sqrt(v) / jnp.sqrt(c2) + eps)

        p = jax.tree_util.tree_map(update, p, m, v)
        return p, m, v, count, loss

    return step


class JaxTrainer:
    """Holds the JAX state of a GPT training run started from a PyTorch model's weights."""

    def __init__(self, model, idx, targets, layers=4, heads=4):
        import jax.numpy as jnp

        self.p = params_of(model)
        self.m = {k: jnp.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: jnp.zeros_like(v) for k, v in self.p.items()}
        self.count = jnp.zeros((), jnp.float32)
        self.idx = jnp.asarray(idx.cpu().numpy().astype("int32"))
        self.targets = jnp.asarray(targets.cpu().numpy().astype("int32"))
        self._step = make_train_step(layers, heads)

    def step(self) -> float:
        self.p, self.m, self.v, self.count, loss = self._step(self.p, self.m, self.v, self.count, self.idx,
                                                              self.targets)
        return float(loss)


class PluginTrainer:
    """The same jax step run by torch_pjrt's PJRT plugin: jax lowers it, torch_pjrt.jax_op runs the
    StableHLO as one program on tpu tensors. Same program as jax.jit, but compiled and run by the
    plugin's XLA, so it isolates what the torch.compile path adds from what the XLA builds differ in."""

    def __init__(self, model, idx, targets, layers=4, heads=4):
        import torch_pjrt

        self.names = [name for name, _ in model.named_parameters()]
        n = len(self.names)
        step = train_step_fn(layers, heads)

        def flat_step(*xs):
            p, m, v = (dict(zip(self.names, xs[i * n:(i + 1) * n])) for i in range(3))
            p, m, v, count, loss = step(p, m, v, xs[3 * n], xs[3 * n + 1], xs[3 * n + 2])
            return tuple(d[k] for d in (p, m, v) for k in self.names) + (count, loss)

        self.op = torch_pjrt.jax_op("bench_jax_gpt::train_step_%d_%d" % (layers, id(self)), flat_step)
        params = [p.detach().to("tpu") for p in model.parameters()]
        self.state = params + [torch.zeros_like(p) for p in params] * 2 + [torch.zeros((), device="tpu")]
        self.data = [idx.to(torch.int32).to("tpu"), targets.to(torch.int32).to("tpu")]

    def step(self) -> float:
        with torch.no_grad():
            outs = self.op(*self.state, *self.data)
        self.state = list(outs[:-1])
        return outs[-1].item()


def check_matches_pytorch(setup, steps=3):
    """Losses of a few steps of the JAX trainer and of PyTorch on the CPU (they should agree)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model, x, y = setup("cpu")
    trainer = JaxTrainer(model, x, y)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pairs = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        pairs.append((loss.item(), trainer.step()))
    return pairs
