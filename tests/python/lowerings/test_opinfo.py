"""PyTorch's OpInfo database: every op's sample inputs, run on tpu and on CPU.

Ops are compared in float32 on up to MAX_SAMPLES samples each. Random ops are
checked for shape and dtype only (another generator), uninitialised ones
(empty*) likewise. The session prints how many ops and samples ran, and how
many of them fell back to the CPU.
"""
import collections

import pytest
import torch
import torch.utils._pytree as pytree

import torch_pjrt

common = pytest.importorskip("torch.testing._internal.common_methods_invocations")

MAX_SAMPLES = 8
RANDOM = {"bernoulli", "exponential", "normal", "uniform", "rand_like", "randn_like", "randint_like", "randint",
          "multinomial", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
          "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout", "nn.functional.rrelu",
          "nn.functional.scaled_dot_product_attention", "nn.functional.multi_head_attention_forward",
          "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "cauchy", "geometric",
          "log_normal", "randn", "rand", "bernoulli", "nn.functional.feature_alpha_dropout"}
UNINITIALISED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
SKIP = {
    "tensor_split": "PyTorch requires its index tensor on the CPU",
    "native_batch_norm": "in eval mode the CPU kernel returns empty saved stats where the meta kernel says [C]",
    "as_strided.partial_views": "samples view past the end of their storage",
    "as_strided_scatter": "samples view past the end of their storage",
    "item": "returns a Python number",
    "to": "samples move the tensor to the CPU on purpose",
    "stft": "complex intermediates (tpu tensors are real)",
    "istft": "complex input (tpu tensors are real)",
}
stats = collections.Counter()


def _name(op):
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _selected():
    for op in common.op_db:
        if torch.float32 not in op.supported_dtypes("cpu") or _name(op) in SKIP:
            continue
        if op.name.startswith(("fft.", "sparse.", "linalg.eig", "to_sparse")) or "complex" in op.name:
            continue
        yield op


OPS = list(_selected())


def _has_complex(tree):
    return any(isinstance(x, torch.Tensor) and (x.is_complex() or x.is_sparse) for x in pytree.tree_leaves(tree))


def _to_tpu(x):
    return x.detach().to("tpu") if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("op", OPS, ids=_name)
def test_opinfo_matches_cpu(op):
    name = _name(op)
    shape_only = op.name in RANDOM or name in RANDOM or op.name in UNINITIALISED
    ran = 0
    for sample in list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:MAX_SAMPLES]:
        args = (sample.input, sample.args, sample.kwargs)
        if _has_complex(args):
            continue
        try:
            expected = op(sample.input, *sample.args, **sample.kwargs)
        except Exception:
            continue  # the CPU rejects this sample too
        if _has_complex(expected):
            continue
        fallbacks_before = sum(torch_pjrt.metrics()["cpu_fallbacks"].values())
        inp, a, kw = pytree.tree_map(_to_tpu, args)
        if "device" in kw:  # factories
            kw = dict(kw, device="tpu")
        actual = op(inp, *a, **kw)
        exp_leaves, act_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
        assert len(exp_leaves) == len(act_leaves)
        for e, x in zip(exp_leaves, act_leaves):
            if not isinstance(e, torch.Tensor):
                continue
            assert x.device.type == "tpu", f"{name}: result left the device"
            assert x.shape == e.shape and x.dtype == e.dtype
            if not shape_only:
                torch.testing.assert_close(x.cpu(), e, equal_nan=True, atol=1e-4, rtol=1e-4, check_stride=False)
        ran += 1
        stats["samples"] += 1
        if sum(torch_pjrt.metrics()["cpu_fallbacks"].values()) > fallbacks_before:
            stats["samples_on_cpu"] += 1
    if ran == 0:
        pytest.skip("no sample runs in float32 on CPU")
    stats["ops"] += 1


def pytest_terminal_summary_lines():
    return [f"OpInfo: {stats['ops']} ops, {stats['samples']} samples matched CPU "
            f"({stats['samples_on_cpu']} of them through a CPU fallback)"]
