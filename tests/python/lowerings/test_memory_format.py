"""Memory formats on tpu follow the CPU: results keep the strides CPU gives
them (channels_last, channels_last_3d, preserved layouts) and the values stay
right, in strict and fused mode."""
import pytest
import torch
import torch.nn.functional as F

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

DEVICE = "tpu"
CL = torch.channels_last
CL3 = torch.channels_last_3d


@pytest.fixture(params=["strict", "fused"])
def mode(request):
    with torch_pjrt.mode(request.param):
        yield request.param


def assert_same(expected, actual):
    """Same values, strides and memory-format flags as the CPU result."""
    assert actual.device.type == DEVICE
    assert actual.stride() == expected.stride(), f"strides {actual.stride()} on tpu, {expected.stride()} on cpu"
    for fmt in (CL, CL3) if expected.dim() in (4, 5) else ():
        if (fmt == CL) == (expected.dim() == 4):
            assert actual.is_contiguous(memory_format=fmt) == expected.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-4)


def on_both(fn, *inputs):
    """fn on CPU inputs and on tpu copies that keep the inputs' strides."""
    expected = fn(*[x.clone() for x in inputs])
    actual = fn(*[x.to(DEVICE) for x in inputs])
    pairs = zip(expected, actual) if isinstance(expected, tuple) else [(expected, actual)]
    for e, a in pairs:
        assert_same(e, a)


def nchw(*shape, fmt=CL):
    torch.manual_seed(sum(shape))
    return torch.randn(*shape).contiguous(memory_format=fmt)


CASES = {
    "contiguous_cl": lambda x: x.contiguous().contiguous(memory_format=CL if x.dim() == 4 else CL3),
    "contiguous_back": lambda x: x.contiguous(),
    "clone_preserve": lambda x: x.clone(),
    "clone_contiguous": lambda x: x.clone(memory_format=torch.contiguous_format),
    "add_scalar": lambda x: x + 1,
    "mul_tensor": lambda x: x * x,
    "mixed_layouts": lambda x: x + x.contiguous(),
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "neg_then_exp": lambda x: x.neg().exp(),
    "where": lambda x: torch.where(x > 0, x, x * 0.1),
    "to_double": lambda x: x.to(torch.float64),
    "in_place_add": lambda x: x.add_(1),
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "sum_channels": lambda x: x.sum(1, keepdim=True),
}


@pytest.mark.parametrize("rank", [4, 5])
@pytest.mark.parametrize("name", list(CASES))
def test_ops_keep_cpu_layout(name, rank, mode):
    x = nchw(2, 3, 4, 5) if rank == 4 else nchw(2, 3, 4, 5, 3, fmt=CL3)
    on_both(CASES[name], x)


@pytest.mark.parametrize("rank", [4, 5])
def test_convolution_output_layout(rank, mode):
    if rank == 4:
        x, w = nchw(2, 3, 6, 5), torch.randn(4, 3, 3, 3)
        on_both(lambda x, w: F.conv2d(x, w, padding=1), x, w)
        on_both(lambda x, w: F.conv2d(x, w, stride=2), x.contiguous(), w.contiguous(memory_format=CL))
    else:
        x, w = nchw(2, 3, 4, 5, 4, fmt=CL3), torch.randn(4, 3, 3, 3, 3)
        on_both(lambda x, w: F.conv3d(x, w, padding=1), x, w)
        on_both(lambda x, w: F.conv3d(x, w, padding=1), x.double(), w.double())


def test_plain_convolution_stays_row_major(mode):
    on_both(lambda x, w: F.conv2d(x, w), torch.randn(2, 3, 6, 5), torch.randn(4, 3, 3, 3))


def test_factories_honor_memory_format(mode):
    for fmt, shape in ((CL, (2, 3, 4, 5)), (CL3, (2, 3, 4, 5, 6))):
        expected = torch.empty(*shape, memory_format=fmt)
        actual = torch.empty(*shape, memory_format=fmt, device=DEVICE)
        assert actual.stride() == expected.stride()
        like = torch.empty_like(actual)
        assert like.stride() == torch.empty_like(expected).stride()
        assert torch.zeros_like(actual).stride() == torch.zeros_like(expected).stride()
        resized = torch.empty(0, device=DEVICE).resize_(*shape, memory_format=fmt)
        assert resized.stride() == torch.empty(0).resize_(*shape, memory_format=fmt).stride()
        # written through the layout, read back in logical order
        source = torch.randn(*shape)
        actual.copy_(source.to(DEVICE))
        torch.testing.assert_close(actual.cpu(), source)


def test_resize_keeps_or_restrides_as_on_cpu(mode):
    # The same sizes keep the strides (and so the values read); new sizes are row-major; a format restrides.
    cases = [((2, 3, 4, 5), {}), ((2, 3, 4, 6), {}), ((2, 3, 4, 5), {"memory_format": torch.contiguous_format}),
             ((2, 3, 4, 5), {"memory_format": CL}), ((120,), {})]
    for size, kw in cases:
        dev = torch.arange(120.).reshape(2, 3, 4, 5).to(DEVICE).contiguous(memory_format=CL)
        cpu = torch.arange(120.).reshape(2, 3, 4, 5).contiguous(memory_format=CL)
        cpu.resize_(*size, **kw)
        dev.resize_(*size, **kw)
        assert dev.stride() == cpu.stride(), (size, kw)
        if cpu.numel() <= 120:
            assert torch.equal(dev.cpu(), cpu), (size, kw)
    y_cpu = torch.arange(6.).reshape(2, 3).t()
    y_dev = torch.arange(6.).reshape(2, 3).to(DEVICE).t()
    y_cpu.resize_(3, 2)
    y_dev.resize_(3, 2)
    assert y_dev.stride() == y_cpu.stride() and torch.equal(y_dev.cpu(), y_cpu)


def test_conv_batch_norm_autograd_channels_last(mode):
    torch.manual_seed(0)
    x0 = nchw(2, 3, 6, 5)
    w0 = torch.randn(4, 3, 3, 3)

    def run(device):
        x = x0.clone().to(device).requires_grad_()
        w = w0.clone().to(device).requires_grad_()
        scale = torch.ones(4, device=device).requires_grad_()
        y = F.conv2d(x, w, padding=1)
        z = F.batch_norm(y, None, None, weight=scale, training=True)
        out = torch.relu(z)
        weights = torch.arange(out.numel(), device=device, dtype=out.dtype).view(out.shape) / out.numel()
        (out * weights).sum().backward()
        return y, z, out, x.grad, w.grad, scale.grad

    for e, a in zip(run("cpu"), run(DEVICE)):
        assert_same(e, a)


@pytest.mark.parametrize("layout", ["channels_last", "sliced_channels_last", "unsqueezed_batch_of_one", "row_major"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_resample_output_follows_the_inputs_suggested_format(mode, layout, dtype):
    # The uint8 path is our own fixed-point algorithm; its layout must follow ATen's suggest_memory_format
    # as the float kernels' do: a sliced channels_last input stays channels_last, a batch of one made by
    # unsqueezing a 3-d channels_last view does not (PyTorch's test_upsamplingBiMode2d_consistency).
    x = torch.randint(0, 256, (2 if layout != "unsqueezed_batch_of_one" else 1, 3, 12, 12)).to(dtype)
    if layout != "row_major":
        x = x.contiguous(memory_format=CL)
    if layout == "sliced_channels_last":
        x = x[:, :, ::2, ::2]
    if layout == "unsqueezed_batch_of_one":
        x = x[0, ...][None, ...]
    for m in ("bilinear", "bicubic"):
        want = F.interpolate(x, size=(5, 7), mode=m, align_corners=False)
        assert_same(want, F.interpolate(x.to(DEVICE), size=(5, 7), mode=m, align_corners=False))
