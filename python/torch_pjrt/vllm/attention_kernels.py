"""Platform attention kernels for vLLM on tpu: a JAX function in place of the portable paged attention lowering.

TpuAttentionBackend (attention.py) attends with torch.nn.attention.varlen.varlen_attn over the layer's page pools
with a block table; on every plugin that reaches `aten::_flash_attention_forward`, whose portable lowering
(csrc/aten/lowerings/packed_attention.cpp) computes dense masked scores of every query against every key slot of
the step's block table. `register_attention_kernel(fn, platform=...)` gives one platform a kernel of its own: a
JAX function of the paged problem (the contract below) that runs, for that plugin's processes, wherever
varlen_attn is called with a block table. It is lowered with torch_pjrt's JAX machinery (`_jax.py`, the
`torch_pjrt::jax_call` op, as `torch_pjrt.register_lowering` and `jax_op` lower theirs), so in fused mode it is
inlined into the same program as the cache write before it and the projection after it.

Where it hooks in: the tpu kernel of `torch_attn::_varlen_attn`, the custom op varlen_attn calls, which gets every
argument (scale, window, block table) as it is. The registry's own platform rules for ATen ops cannot take it yet:
`torch_pjrt.register_lowering` passes a JAX function only the op's tensors and refuses (runs on the CPU) any call
that sets another argument to a value other than its default, and `_flash_attention_forward`'s `max_q`, `max_k`,
`dropout_p`, `is_causal` and `return_debug_mask` have no default, so every call of it would be refused (and the op
has no CPU kernel): see docs/serving.md, "Platform attention kernels". A call without a block table (training,
packed keys), and every call on a platform without a kernel, takes the portable lowering as before.

The kernel contract (what `fn` is called with, JAX arrays, inside jax.jit):

    fn(query, key_pages, value_pages, cu_seq_q, seqused_k, block_table, *, scale, window_left, window_right)
        query        [T, H, D]            the step's packed queries (T: the token bucket)
        key_pages    [P, page, Hkv, D]    the layer's key pool, value_pages [P, page, Hkv, Dv] its value pool
        cu_seq_q     int32 [N + 1]        request r's queries are rows cu_seq_q[r] .. cu_seq_q[r + 1]
        seqused_k    int32 [N]            request r's key count (its new tokens' keys included)
        block_table  int32 [N, M]         key j of request r is row j % page of page block_table[r, j // page]
        scale        float                the scores' factor
        window_left, window_right  int    query i of request r (Lq queries, Lk keys) sees key j when
                                          j <= i + Lk - Lq + window_right and j >= i + Lk - Lq - window_left;
                                          -1: no limit that side. Causal attention is (-1, 0).
    returns (out [T, H, Dv], lse [H, T]) or out alone. out is converted to query's dtype; lse (float32, the
    log-sum-exp of each row's scaled scores, +inf for a row that sees no key) is what varlen_attn returns with
    return_aux=AuxRequest(lse=True); a kernel that returns no lse gets NaN there. Rows of tokens past
    cu_seq_q[N] (bucket padding) belong to no request: the portable lowering and ragged_paged_attention give
    them zeros, other kernels may leave anything there (vLLM never reads them). Query head h reads key head
    h // (H // Hkv) (grouped-query attention).

How a platform turns it on:

- from Python, in the process that runs the model: `torch_pjrt.vllm.attention_kernels.register_attention_kernel()`
  (the pure-JAX `ragged_paged_attention` for this process's plugin) or `register_attention_kernel(fn,
  platform="tpu")`; `unregister_attention_kernel(platform)` goes back to the portable lowering.
- in vLLM, whose model runs in spawned worker processes: the engine argument
  `additional_config={"torch_pjrt_attention_kernel": "jax"}` (`--additional-config` on the server), or
  `"package.module:function"` naming a JAX function with the contract above; TpuWorker registers it for its
  process's platform before the model is built (`apply_vllm_setting`). Unset or "portable": the portable lowering.

The Pallas kernel on libtpu: `pallas_ragged_paged_attention` adapts the contract to
jax.experimental.pallas.ops.tpu.ragged_paged_attention. It is untested on TPU (this project's CI has no libtpu);
its layout conversion is checked against that module's reference implementation on the CPU.
"""
from __future__ import annotations

import importlib
import math
import threading
from typing import Callable

import torch

PLATFORMS = ("cpu", "cuda", "tpu")
SETTING = "torch_pjrt_attention_kernel"  # the key in vLLM's additional_config

_lock = threading.Lock()
_kernels: dict[str, Callable] = {}  # platform -> the JAX kernel registered for it
_installed = False  # the tpu kernel of torch_attn::_varlen_attn
_platform: str | None = None
_keys: dict = {}  # (kernel, scale, window, argument types) -> the registered jax_call module
_calls = 0  # varlen_attn calls that took a platform kernel (tests read it through kernel_calls())


# ---------------------------------------------------------------------------------------------------------------
# The default kernel: ragged paged attention in pure JAX.
# ---------------------------------------------------------------------------------------------------------------

def ragged_paged_attention(query, key_pages, value_pages, cu_seq_q, seqused_k, block_table, *, scale,
                           window_left=-1, window_right=0, queries_per_block=8, keys_per_block=128):
    """Attention of packed, ragged queries over paged keys and values, in pure JAX (the contract above).

    A flash-attention loop, sequential over requests: for each request, blocks of `queries_per_block` of its
    queries, and for each block, the blocks of `keys_per_block` key slots (whole pages) its causal and window
    limits let it see, gathered from the request's pages, with an online softmax in float32. The loops' trip
    counts are the runtime lengths (a request without queries costs nothing, a decode query reads only its
    request's pages), so the work is that of the real problem rather than of every query against every slot of
    the block table. Rows that see no key give zeros and a log-sum-exp of +inf, as the flash kernel does.
    """
    import jax.numpy as jnp
    from jax import lax

    f32, i32 = jnp.float32, jnp.int32
    tokens, heads, width = query.shape
    _, page, kv_heads, _ = key_pages.shape
    value_width = value_pages.shape[-1]
    requests, pages_per_row = block_table.shape
    if heads % kv_heads:
        raise ValueError(f"ragged_paged_attention: {heads} query heads are not a multiple of {kv_heads} key heads")
    group = heads // kv_heads
    bq = max(1, min(queries_per_block, tokens))
    kp = max(1, min(pages_per_row, keys_per_block // page))  # pages per key block
    bk = kp * page
    hi_prec = lax.Precision.HIGHEST  # float32 products in float32, as the portable lowering's

    # Padded by one block of rows: a request's last query block may run past the last token.
    q = jnp.pad(query.astype(f32).reshape(tokens, kv_heads, group, width), ((0, bq), (0, 0), (0, 0), (0, 0)))
    out = jnp.zeros((tokens + bq, kv_heads, group, value_width), f32)
    lse = jnp.full((tokens + bq, kv_heads, group), jnp.inf, f32)
    cu = cu_seq_q.astype(i32)
    used = seqused_k.astype(i32)
    table = block_table.astype(i32)

    def request(r, carry):
        first = cu[r]
        q_len = cu[r + 1] - first
        k_len = used[r]
        pages = table[r]
        offset = k_len - q_len  # bottom-right alignment: query i's diagonal key is i + offset

        def query_block(b, carry):
            out, lse = carry
            start = first + b * bq
            qb = lax.dynamic_slice(q, (start, 0, 0, 0), (bq, kv_heads, group, width))
            rows = b * bq + jnp.arange(bq, dtype=i32)  # positions in the request
            row_ok = rows < q_len
            diagonal = rows + offset
            # The key slots this block can see: [lo, hi).
            last = jnp.minimum(b * bq + bq, q_len) - 1 + offset
            hi = k_len if window_right < 0 else jnp.clip(last + window_right + 1, 0, k_len)
            lo = 0 if window_left < 0 else jnp.maximum(b * bq + offset - window_left, 0)

            def key_block(kb, state):
                m, l, acc = state
                j = kb * bk + jnp.arange(bk, dtype=i32)
                ids = pages[jnp.clip(kb * kp + jnp.arange(kp, dtype=i32), 0, pages_per_row - 1)]
                key_ok = j < k_len
                kblk = key_pages[ids].reshape(bk, kv_heads, width).astype(f32)
                # Slots past the request's keys may hold anything (another request's rows, uninitialised
                # pages): zero them so that a zero probability never meets an inf or NaN value.
                vblk = jnp.where(key_ok[:, None, None], value_pages[ids].reshape(bk, kv_heads, value_width).astype(f32),
                                 0.0)
                s = jnp.einsum("qhgd,khd->hgqk", qb, kblk, precision=hi_prec) * scale
                seen = row_ok[:, None] & key_ok[None, :]
                if window_right >= 0:
                    seen &= j[None, :] <= diagonal[:, None] + window_right
                if window_left >= 0:
                    seen &= j[None, :] >= diagonal[:, None] - window_left
                s = jnp.where(seen, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=-1))
                shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # exp(-inf - -inf) would be NaN
                p = jnp.exp(s - shift[..., None])
                rescale = jnp.exp(m - shift)
                l = l * rescale + p.sum(axis=-1)
                acc = acc * rescale[..., None] + jnp.einsum("hgqk,khd->hgqd", p, vblk, precision=hi_prec)
                return m_new, l, acc

            init = (jnp.full((kv_heads, group, bq), -jnp.inf, f32), jnp.zeros((kv_heads, group, bq), f32),
                    jnp.zeros((kv_heads, group, bq, value_width), f32))
            m, l, acc = lax.fori_loop(lo // bk, (hi + bk - 1) // bk, key_block, init)
            any_key = l > 0  # a row that sees a key has l >= 1 (its largest score gives exp(0))
            ob = jnp.where(any_key[..., None], acc / jnp.where(any_key, l, 1.0)[..., None], 0.0)
            lb = jnp.where(any_key, m + jnp.log(jnp.where(any_key, l, 1.0)), jnp.inf)
            ob = jnp.transpose(ob, (2, 0, 1, 3))  # [bq, Hkv, group, Dv]
            lb = jnp.transpose(lb, (2, 0, 1))
            # Rows past the request's queries are the next request's: keep what is there.
            keep = lax.dynamic_slice(out, (start, 0, 0, 0), ob.shape)
            out = lax.dynamic_update_slice(out, jnp.where(row_ok[:, None, None, None], ob, keep), (start, 0, 0, 0))
            keep = lax.dynamic_slice(lse, (start, 0, 0), lb.shape)
            lse = lax.dynamic_update_slice(lse, jnp.where(row_ok[:, None, None], lb, keep), (start, 0, 0))
            return out, lse

        return lax.fori_loop(0, (q_len + bq - 1) // bq, query_block, carry)

    out, lse = lax.fori_loop(0, requests, request, (out, lse))
    out = out[:tokens].reshape(tokens, heads, value_width).astype(query.dtype)
    lse = lse[:tokens].reshape(tokens, heads).T
    return out, lse


# ---------------------------------------------------------------------------------------------------------------
# The Pallas kernel on libtpu (untested here).
# ---------------------------------------------------------------------------------------------------------------

def pallas_ragged_paged_attention(query, key_pages, value_pages, cu_seq_q, seqused_k, block_table, *, scale,
                                  window_left=-1, window_right=0, kernel=None, **tuning):
    """The contract above through jax.experimental.pallas.ops.tpu.ragged_paged_attention (a Mosaic kernel: TPU
    only). UNTESTED on TPU. What it adapts:

    - KV layout: the Pallas kernel reads one pool [P, page, 2 * Hkv, D] with key head h at slot 2h and value
      head h at 2h + 1; the backend's cache keeps keys and values as two pools [P, page, Hkv, D]. They are
      interleaved here, a copy of the layer's whole cache every call: the price of plugging the kernel into
      the backend unchanged. Without it, the backend's cache (TpuAttentionBackend.kv_cache_shape) and its
      slot write would have to hold the combined layout, and varlen_attn (the portable path) would read the
      pools as strided views of it. Keys and values must have the same head size.
    - num_seqs: the kernel takes the number of real requests (int32 [1]); the backend pads requests at the end
      with no queries and no keys, so it is the count of requests with keys.
    - limits: causal only (window_right 0); window_left W - 1 is its sliding_window W. It requires each
      request's queries to be no more than its keys (always so in vLLM: the new tokens' keys are in the cache).
    - no log-sum-exp: lse is left to the caller (NaN). Rows past the last request's queries are not written.
    - head_dim and heads per block follow the kernel's own constraints (get_min_heads_per_blk,
      tuned_block_sizes); `tuning` passes num_kv_pages_per_block, num_queries_per_block, vmem_limit_bytes.

    `kernel` replaces the Pallas function (tests pass the module's ref_ragged_paged_attention, eagerly).
    """
    import jax.numpy as jnp

    if window_right != 0:
        raise NotImplementedError("the Pallas ragged paged attention kernel is causal only")
    if kernel is None:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
    pages, page, kv_heads, width = key_pages.shape
    combined = jnp.stack([key_pages, value_pages.astype(key_pages.dtype)], axis=3).reshape(
        pages, page, 2 * kv_heads, width)
    used = seqused_k.astype(jnp.int32)
    num_seqs = jnp.sum(used > 0, dtype=jnp.int32).reshape(1)
    out = kernel(query, combined, used, block_table.astype(jnp.int32), cu_seq_q.astype(jnp.int32), num_seqs,
                 sm_scale=scale, sliding_window=None if window_left < 0 else window_left + 1, **tuning)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Registration.
# ---------------------------------------------------------------------------------------------------------------

def _this_platform() -> str:
    global _platform
    if _platform is None:
        import torch_pjrt

        _platform = torch_pjrt.platform()["name"]
    return _platform


def register_attention_kernel(fn: Callable | None = None, platform: str | None = None) -> Callable:
    """Makes fn (a JAX function with the contract in this module's docstring; default ragged_paged_attention)
    vLLM's attention on `platform` ("cpu", "cuda", "tpu"; default this process's plugin): varlen_attn calls
    with a block table on that plugin run it instead of the portable lowering. Registering again replaces the
    platform's kernel. Returns fn."""
    if fn is None:
        fn = ragged_paged_attention
    if not callable(fn):
        raise TypeError(f"register_attention_kernel: fn must be a JAX function, not {type(fn).__name__}")
    if platform is None:
        platform = _this_platform()
    if platform not in PLATFORMS:
        raise ValueError(f"register_attention_kernel: platform must be one of {PLATFORMS}, not {platform!r}")
    with _lock:
        _kernels[platform] = fn
    _install()
    return fn


def unregister_attention_kernel(platform: str | None = None) -> Callable | None:
    """Takes `platform`'s kernel away (varlen_attn goes back to the portable lowering); returns it, or None."""
    with _lock:
        return _kernels.pop(platform or _this_platform(), None)


def attention_kernel(platform: str | None = None) -> Callable | None:
    """The kernel registered for `platform` (default this process's plugin), or None (the portable lowering)."""
    with _lock:
        return _kernels.get(platform or _this_platform())


def kernel_calls() -> int:
    """How many varlen_attn calls took a registered kernel in this process."""
    return _calls


def kernel_from_setting(value) -> Callable | None:
    """The kernel an `additional_config["torch_pjrt_attention_kernel"]` value names: None for unset/"portable",
    ragged_paged_attention for "jax", else the function "package.module:function" names."""
    if value is None or value == "" or value == "portable":
        return None
    if value == "jax":
        return ragged_paged_attention
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"additional_config[{SETTING!r}] must be 'portable', 'jax' or 'package.module:function', "
                         f"not {value!r}")
    module, _, name = value.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"additional_config[{SETTING!r}] = {value!r} is not a function")
    return fn


def apply_vllm_setting(additional_config) -> Callable | None:
    """Registers, for this process's platform, the kernel vLLM's additional_config names (TpuWorker calls it in
    each worker process before the model is built); returns it, or None when the setting asks for none."""
    value = additional_config.get(SETTING) if isinstance(additional_config, dict) else None
    fn = kernel_from_setting(value)
    if fn is not None:
        register_attention_kernel(fn)
    return fn


# ---------------------------------------------------------------------------------------------------------------
# The hook: torch_attn::_varlen_attn's tpu kernel.
# ---------------------------------------------------------------------------------------------------------------

def _install() -> None:
    """Gives torch_attn::_varlen_attn a tpu kernel (once): a registered kernel where it applies, else what the
    op's own implementation does (the portable lowering of _flash_attention_forward)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    from torch.nn.attention import varlen

    varlen._varlen_attn.register_kernel("tpu")(_varlen_attn_tpu)


def _portable(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size, seqused_k,
              block_table, num_splits):
    # torch.nn.attention.varlen._varlen_attn's own flash branch.
    left, right = (-1, -1) if window_size is None else window_size
    output, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, is_causal, return_debug_mask=False,
        scale=scale, window_size_left=left, window_size_right=right, seqused_k=seqused_k, block_table=block_table,
        num_splits=num_splits)
    return output, lse, torch.zeros((2,), dtype=torch.uint64, device=query.device)


def _varlen_attn_tpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                     window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    global _calls
    with _lock:
        fn = _kernels.get(_this_platform())
    if (fn is None or block_table is None or seqused_k is None or query.dim() != 3 or key.dim() != 4
            or value.dim() != 4 or cu_seq_q is None or not query.dtype.is_floating_point):
        return _portable(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale, window_size,
                         seqused_k, block_table, num_splits)
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if is_causal:
        right = 0
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    # JAX without jax_enable_x64 has no int64: the metadata goes as int32 (vLLM's already is).
    meta = [t if t.dtype == torch.int32 else t.to(torch.int32) for t in (cu_seq_q, seqused_k, block_table)]
    args = [query, key, value, *meta]
    module = _module(fn, scale, left, right, args)  # defines torch_pjrt::jax_call on first use
    out, lse = torch.ops.torch_pjrt.jax_call(args, module)
    _calls += 1
    return out, lse, torch.zeros((2,), dtype=torch.uint64, device=query.device)


def _module(fn, scale, left, right, args):
    """The jax_call module of fn for this configuration and these argument types (lowered once)."""
    from .. import _jax

    types = tuple((tuple(a.shape), a.dtype) for a in args)
    cache_key = (fn, scale, left, right, types)
    key = _keys.get(cache_key)
    if key is None:
        _jax._define_jax_call()
        key = _keys[cache_key] = _jax._register_lowering(_bound(fn, scale, left, right, args), args,
                                                         f"attention kernel {getattr(fn, '__name__', fn)}")
    return key


def _bound(fn, scale, left, right, args):
    """fn for one configuration, as a function of the six tensors giving (out, lse) of the op's types."""
    tokens, heads = args[0].shape[0], args[0].shape[1]
    value_width = args[2].shape[-1]

    def call(query, key_pages, value_pages, cu_seq_q, seqused_k, block_table):
        import jax.numpy as jnp

        result = fn(query, key_pages, value_pages, cu_seq_q, seqused_k, block_table, scale=scale,
                    window_left=left, window_right=right)
        out, lse = result if isinstance(result, (tuple, list)) else (result, None)
        if lse is None:
            lse = jnp.full((heads, tokens), jnp.nan, jnp.float32)
        if tuple(out.shape) != (tokens, heads, value_width) or tuple(lse.shape) != (heads, tokens):
            raise ValueError(f"attention kernel {getattr(fn, '__name__', fn)}: returned out {list(out.shape)} and "
                             f"lse {list(lse.shape)}, the op's are {[tokens, heads, value_width]} and "
                             f"{[heads, tokens]}")
        return out.astype(query.dtype), lse.astype(jnp.float32)

    call.__name__ = f"attention_kernel_{getattr(fn, '__name__', 'fn')}"
    return call
