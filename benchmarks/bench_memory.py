"""Peak host RSS per operation on a large uint8 tensor, as a multiple of the tensor's size.

The CPU plugin's device memory is host memory: each copy on the way (a staging tensor, a materialized
convert) shows as one more tensor size. Each operation runs in its own fresh process, and its peak is
measured from the RSS just before it (VmHWM reset through /proc/self/clear_refs), next to the same
operation on CPU PyTorch.

    PYTHONPATH=python python benchmarks/bench_memory.py            # 256 MiB
    PYTHONPATH=python python benchmarks/bench_memory.py --mib 2048 --check-big-index

Sizes near 2^31 bytes need about 4-6x that much free memory for the whole run: run one at a time on a
shared machine. --check-big-index (manual, not in CI: too big) also checks indexing, a slice at an offset
past 2^31 elements and sums against the CPU.
"""
import argparse
import os
import subprocess
import sys
import textwrap

SETUP = {
    "tpu": "host = torch.arange(256, dtype=torch.uint8).repeat(N // 256); d = host.to('tpu'); torch.tpu.synchronize()",
    "cpu": "d = torch.arange(256, dtype=torch.uint8).repeat(N // 256)",
}
OPS = {  # name: (setup needed, operation)
    "create on cpu": (False, "x = torch.ones(N, dtype=torch.uint8)"),
    "cpu -> to(dev)": (False, "h = torch.ones(N, dtype=torch.uint8); reset(); x = h.to(DEV); sync()"),
    "empty on dev": (False, "x = torch.empty(N, dtype=torch.uint8, device=DEV); sync()"),
    "zeros on dev": (False, "x = torch.zeros(N, dtype=torch.uint8, device=DEV); sync()"),
    "full on dev": (False, "x = torch.full((N,), 7, dtype=torch.uint8, device=DEV); sync()"),
    "x.add_(1)": (True, "d.add_(1); sync()"),
    "y = x + 1": (True, "y = d + 1; sync()"),
    "x.sum()": (True, "s = d.sum().item()"),
    "x.float().mean()": (True, "s = d.float().mean().item()"),
    "x.cpu()": (True, "h = d.cpu()"),
}

PROBE = textwrap.dedent(
    """
    import gc, sys, torch
    DEV = sys.argv[2]
    if DEV == 'tpu':
        import torch_pjrt
    def sync():
        if DEV == 'tpu':
            torch.tpu.synchronize()
    def status():
        with open('/proc/self/status') as f:
            fields = dict(line.split(':', 1) for line in f)
        return int(fields['VmRSS'].split()[0]) * 1024, int(fields['VmHWM'].split()[0]) * 1024
    def reset():
        global before
        gc.collect()
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        before = status()[0]
    N = int(sys.argv[1])
    {setup}
    reset()
    {op}
    print('PEAK', status()[1] - before)
    """
)

BIG_INDEX = textwrap.dedent(
    """
    import sys, torch, torch_pjrt
    N = int(sys.argv[1])
    host = torch.arange(256, dtype=torch.uint8).repeat(N // 256)  # element i is i % 256
    d = host.to('tpu')
    del host  # (the CPU's own uint8 sum would write an int64 copy: expected sums are computed instead)
    def expected_sum(a, b):  # sum of i % 256 for a <= i < b
        f = lambda n: (n // 256) * 32640 + (n % 256) * (n % 256 - 1) // 2
        return f(b) - f(a)
    for i in (0, 2**31 - 1, 2**31, 2**31 + 12345, N - 1):
        if i < N:
            assert d[i].item() == i % 256, i
    if N > 2**31 + 64:
        want = (torch.arange(2**31 + 3, 2**31 + 64) % 256).to(torch.uint8)
        assert torch.equal(d[2**31 + 3: 2**31 + 64].cpu(), want)
        assert d[2**31 + 5:].sum().item() == expected_sum(2**31 + 5, N)
        d[2**31 + 7] = 3
        assert d[2**31 + 7].item() == 3 and d[2**31 + 6].item() == (2**31 + 6) % 256
        d[2**31 + 7] = (2**31 + 7) % 256
    assert d.sum().item() == expected_sum(0, N)
    print('big-index checks passed for', N, 'elements')
    """
)


def run(code, *args):
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1:] or ["failed"]
    return int([l for l in out.stdout.splitlines() if l.startswith("PEAK")][-1].split()[1]), None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256, help="tensor size in MiB (uint8: that many Mi elements)")
    parser.add_argument("--check-big-index", action="store_true", help="manual: correctness past 2^31 elements")
    args = parser.parse_args()
    n = args.mib << 20
    os.environ.setdefault("TORCH_PJRT_MODE", "fused")
    print(f"uint8 tensor of {args.mib} MiB, mode {os.environ['TORCH_PJRT_MODE']}: peak RSS above the start, "
          "in tensor sizes")
    print(f"{'operation':20s} {'cpu':>8s} {'tpu':>8s} {'tpu/cpu':>8s}")
    for name, (needs, op) in OPS.items():
        row = []
        for dev in ("cpu", "tpu"):
            code = PROBE.format(setup=SETUP[dev] if needs else "", op=op)
            peak, err = run(code, n, dev)
            row.append(peak / n if peak is not None else None)
            if err:
                print(f"  {name} on {dev} failed: {err[0]}")
        cpu, tpu = row
        ratio = f"{tpu / cpu:8.2f}" if cpu and tpu is not None and cpu > 0.01 else f"{'-':>8s}"
        fmt = lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8s}"  # noqa: E731
        print(f"{name:20s} {fmt(cpu)} {fmt(tpu)} {ratio}", flush=True)
    if args.check_big_index:
        out = subprocess.run([sys.executable, "-c", BIG_INDEX, str(n)], capture_output=True, text=True)
        print(out.stdout.strip() or out.stderr.strip()[-2000:])


if __name__ == "__main__":
    main()
