"""Host memory of large tensors: the CPU plugin's device memory is host memory, so every extra copy on the
way (a staging tensor, a materialized convert) is one more tensor's worth of RSS. Peaks are measured in a
fresh subprocess per operation (VmHWM reset through /proc/self/clear_refs), on 256 MiB tensors; the bounds
are fractions of the tensor size that the old copies exceeded (uint8 sum: +8x, .cpu(): +2x)."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_pjrt

MIB = 1 << 20
N = 256 * MIB

_PROBE = textwrap.dedent(
    """
    import gc, sys, torch, torch_pjrt
    def status():
        with open('/proc/self/status') as f:
            fields = dict(line.split(':', 1) for line in f)
        return int(fields['VmRSS'].split()[0]) * 1024, int(fields['VmHWM'].split()[0]) * 1024
    N = int(sys.argv[1])
    host = torch.arange(256, dtype=torch.uint8).repeat(N // 256)  # values 0..255, repeating
    d = host.to('tpu')
    torch.tpu.synchronize()
    gc.collect()
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # peak RSS := current RSS
    before, _ = status()
    {op}
    _, peak = status()
    print('PEAK', peak - before)
    {check}
    """
)


def _peak_above(op: str, check: str) -> int:
    env = dict(os.environ, TORCH_PJRT_MODE=os.environ.get("TORCH_PJRT_MODE", "fused"), PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(op=op, check=check), str(N)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [l for l in out.stdout.splitlines() if l.startswith("PEAK")][-1]
    return int(line.split()[1])


needs_proc = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs") or torch_pjrt.get_mode() != "fused",
    reason="needs Linux /proc peak-RSS reset; measured in fused mode, the default (each probe is a 256 MiB subprocess)")


@needs_proc
def test_uint8_sum_does_not_materialize_int64_copy():
    # The sum widens to int64: XLA:CPU used to write the whole converted input (8x) before reducing it.
    # (checked after the peak: the CPU's own uint8 sum makes an int64 copy)
    extra = _peak_above("s = d.sum().item()", "assert s == host.sum().item(), (s, host.sum().item())")
    assert extra < N, f"peak RSS rose {extra / N:.2f}x the tensor size during a uint8 sum"


@needs_proc
def test_cpu_reads_without_staging_copy():
    # .cpu() holds its result (1x); a staging tensor copied into it made the peak 2x.
    extra = _peak_above("h = d.cpu()", "assert torch.equal(h, host)")
    assert extra < 1.5 * N, f"peak RSS rose {extra / N:.2f}x the tensor size during .cpu()"


# The reductions that take the first tree level themselves (inputs of 2^20 elements or more, reduced over
# trailing dims, sizes not a multiple of 32: the padded tail block) against the CPU.
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.float32, torch.float16, torch.bool])
def test_large_trailing_reductions_match_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        x = torch.rand(3, 5, 70001, generator=g) > 0.5
    elif dtype.is_floating_point:
        x = torch.randn(3, 5, 70001, generator=g).to(dtype)
    else:
        x = torch.randint(0, 100, (3, 5, 70001), generator=g).to(dtype)
    d = x.to("tpu")
    exact = not dtype.is_floating_point
    checks = [
        lambda t: t.sum(),
        lambda t: t.sum(dim=-1),
        lambda t: t.sum(dim=(1, 2), keepdim=True),
        lambda t: t.sum(dim=0),  # not trailing: XLA's own reduction
        lambda t: t.amax(),
        lambda t: t.amin(dim=(1, 2)),
        lambda t: t.any(dim=-1),
        lambda t: t.all(),
    ]
    if dtype.is_floating_point:
        checks += [lambda t: t.mean(dim=-1), lambda t: t.var(dim=-1), lambda t: t.norm(dim=-1), lambda t: t.max()]
    for f in checks:
        want, got = f(x), f(d).cpu()
        assert got.dtype == want.dtype
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2e-3 if dtype == torch.float16 else 1e-5, atol=1e-3)


def test_large_reduction_keeps_nan():
    x = torch.randn(1 << 20)
    x[777777] = float("nan")
    d = x.to("tpu")
    for f in (torch.sum, torch.amax, torch.amin, torch.max):
        assert torch.isnan(f(d).cpu()), f
