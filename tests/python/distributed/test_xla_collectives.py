"""Collectives across several devices of ONE process as one XLA program
(torch_pjrt._xla_collectives), against a NumPy / CPU PyTorch reference.

The device count is fixed when the runtime starts, so each case runs a script
in a subprocess with TORCH_PJRT_CPU_DEVICES=N (N = 2 and 4) under a hard
timeout, in the mode of the surrounding run (TORCH_PJRT_MODE).
"""
import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent(
    r"""
    import sys, threading, time
    import numpy as np
    import torch, torch_pjrt
    from torch_pjrt import _xla_collectives as xc

    N = torch.tpu.device_count()
    assert N == int(sys.argv[1]), (N, sys.argv)
    DEV = [f"tpu:{i}" for i in range(N)]
    g = torch.Generator().manual_seed(0)

    def inputs(shape, dtype):
        # One CPU tensor per replica, small integers for int64/prod, random floats otherwise.
        out = []
        for r in range(N):
            if dtype in (torch.int64, torch.int32):
                out.append(torch.randint(-4, 5, shape, generator=g, dtype=dtype))
            elif dtype == torch.bool:
                out.append(torch.randint(0, 2, shape, generator=g).bool())
            else:
                out.append(torch.randn(shape, generator=g).to(dtype))
        return out

    def non_contiguous(x, dev):
        # A transposed view with a storage offset: the collective must read the view, not its storage.
        base = torch.zeros(x.shape[-1] + 2, *x.shape[:-1], dtype=x.dtype)
        base[1:-1] = x.movedim(-1, 0)
        t = base.to(dev)[1:-1].movedim(0, -1)
        assert not t.is_contiguous() and t.storage_offset() > 0
        return t

    def to_devices(xs, contiguous=True):
        return [x.to(d) if contiguous else non_contiguous(x, d) for x, d in zip(xs, DEV)]

    def np_of(x):
        return x.float().numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()

    def reduce_ref(xs, op):
        # NumPy over the stacked replicas; f16/bf16 in float32, rounded once (as the program does).
        a = np.stack([np_of(x) for x in xs])
        if xs[0].dtype == torch.bool:
            r = {"sum": a.any(0), "max": a.any(0), "min": a.all(0), "prod": a.all(0)}[op]
        else:
            r = {"sum": a.sum(0), "avg": a.sum(0) / len(xs), "max": a.max(0), "min": a.min(0),
                 "prod": a.prod(0)}[op]
        return torch.from_numpy(np.asarray(r)).to(xs[0].dtype)

    def check(got, want, what, exact=False):
        got = got.cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
        if exact or not want.is_floating_point():
            assert torch.equal(got, want), (what, got, want)
        else:
            tol = 1e-2 if want.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True, msg=what)
    """
)

COLLECTIVES = PRELUDE + textwrap.dedent(
    r"""
    DTYPES = (torch.float32, torch.bfloat16, torch.int64)
    for dtype in DTYPES:
        for contiguous in (True, False):
            tag = f"{dtype} contiguous={contiguous}"
            # all_reduce: every op on an odd shape; avg only for floats.
            xs = inputs((7, 3), dtype)
            for op in ("sum", "avg", "max", "min", "prod"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                outs = xc.all_reduce(to_devices(xs, contiguous), op)
                for r, out in enumerate(outs):
                    assert out.device == torch.device(DEV[r]), (out.device, r)
                    check(out, reduce_ref(xs, op), f"all_reduce {op} {tag} rank {r}")
            # all_gather along dim 0 and along the last dim.
            for dim in (0, -1):
                want = torch.cat(xs, dim)
                for r, out in enumerate(xc.all_gather(to_devices(xs, contiguous), dim=dim)):
                    check(out, want, f"all_gather dim={dim} {tag} rank {r}", exact=True)
            # reduce_scatter / all_to_all: the split dim holds 3 rows per replica.
            ys = inputs((3 * N, 5), dtype)
            full = reduce_ref(ys, "sum")
            for r, out in enumerate(xc.reduce_scatter(to_devices(ys, contiguous), "sum")):
                check(out, full[3 * r: 3 * r + 3], f"reduce_scatter {tag} rank {r}")
            for r, out in enumerate(xc.all_to_all(to_devices(ys, contiguous))):
                check(out, torch.cat([y[3 * r: 3 * r + 3] for y in ys]), f"all_to_all {tag} rank {r}", exact=True)
            # collective_permute: a ring (send to the next rank), and a single send 0 -> N-1.
            ring = [(r, (r + 1) % N) for r in range(N)]
            for r, out in enumerate(xc.collective_permute(to_devices(xs, contiguous), ring)):
                check(out, xs[(r - 1) % N], f"permute ring {tag} rank {r}", exact=True)
            for r, out in enumerate(xc.collective_permute(to_devices(xs, contiguous), [(0, N - 1)])):
                want = xs[0] if r == N - 1 else torch.zeros_like(xs[0])
                check(out, want, f"permute 0->{N - 1} {tag} rank {r}", exact=True)
            for src in (0, N - 1):
                for r, out in enumerate(xc.broadcast(to_devices(xs, contiguous), src=src)):
                    check(out, xs[src], f"broadcast src={src} {tag} rank {r}", exact=True)
    print("ok dtypes")

    # bool reductions (sum/max = or, min/prod = and), 0-d tensors, a 1-element tensor.
    bs = inputs((9,), torch.bool)
    for op in ("sum", "max", "min", "prod"):
        check(xc.all_reduce(to_devices(bs), op)[0], reduce_ref(bs, op), f"bool {op}")
    # Empty tensors, never-written storages (zeros), a dtype view of another dtype's storage.
    empty = xc.all_gather([torch.empty(0, 3, device=d) for d in DEV], dim=1)
    assert all(e.shape == (0, 3 * N) and e.device == torch.device(d) for e, d in zip(empty, DEV)), empty
    check(xc.all_reduce([torch.empty(5, device=d) for d in DEV])[0], torch.zeros(5), "never written")
    fs = inputs((2, 3), torch.float32)
    ints = xc.all_reduce([f.to(d).view(torch.int32) for f, d in zip(fs, DEV)], "max")
    check(ints[0], torch.stack([f.view(torch.int32) for f in fs]).max(0).values, "int32 view of floats")
    zs = [torch.tensor(float(r) + 0.5) for r in range(N)]
    check(xc.all_reduce(to_devices(zs))[N - 1], reduce_ref(zs, "sum"), "0-d all_reduce")
    check(xc.broadcast(to_devices(zs), src=N - 1)[0], zs[N - 1], "0-d broadcast", exact=True)

    # Tensors whose buffer is larger than they are (capacity storages: an arange, a mask grown by cats).
    grown = [torch.cat([torch.arange(5, device=d) * (r + 1), torch.full((2,), r, device=d)]) for r, d in enumerate(DEV)]
    want = [torch.cat([torch.arange(5) * (r + 1), torch.full((2,), r)]) for r in range(N)]
    check(xc.all_reduce(grown)[0], reduce_ref(want, "sum"), "capacity storages")
    check(xc.all_reduce([torch.arange(3, device=d) for d in DEV])[N - 1], torch.arange(3) * N, "arange")

    # max/min propagate NaN from any replica; broadcast keeps -0.0 bit-exact.
    xs = inputs((4,), torch.float32)
    xs[N - 1][2] = float("nan")
    for op in ("max", "min"):
        out = xc.all_reduce(to_devices(xs), op)[0].cpu()
        assert out.isnan().tolist() == [False, False, True, False], (op, out)
        check(out, reduce_ref(xs, op), f"nan {op}")
    odd_bits = torch.tensor([-0.0, float("nan"), 1.0]).view(torch.int32)
    odd_bits[1] += 5  # a NaN with its own payload
    special = [odd_bits.view(torch.float32)] + [torch.tensor([5.0, 5.0, 5.0])] * (N - 1)
    for out in xc.broadcast(to_devices(special), src=0):
        assert torch.equal(out.cpu().view(torch.int32), odd_bits), (out.cpu().view(torch.int32), odd_bits)
    for dtype in (torch.bool, torch.complex64, torch.float16):
        ws = [torch.randn(5, generator=g).to(dtype) for _ in range(N)]
        for out in xc.broadcast(to_devices(ws), src=N - 1):
            check(out, ws[N - 1], f"broadcast {dtype}", exact=True)
    cs = [torch.randn(3, generator=g, dtype=torch.complex64) for _ in range(N)]
    check(xc.all_reduce(to_devices(cs), "sum")[0], torch.stack(cs).sum(0), "complex sum")

    # Groups: replicas {even} and {odd} reduce among themselves.
    if N == 4:
        xs = inputs((5,), torch.float32)
        outs = xc.all_reduce(to_devices(xs), groups=[[0, 2], [1, 3]])
        for r in range(N):
            check(outs[r], reduce_ref([xs[r % 2], xs[r % 2 + 2]], "sum"), f"groups rank {r}")
        outs = xc.all_gather(to_devices(xs), groups=[[3, 1], [2, 0]])
        check(outs[1], torch.cat([xs[3], xs[1]]), "group order is list order", exact=True)
        outs = xc.broadcast(to_devices(xs), src=1, groups=[[0, 2], [1, 3]])
        for r in range(N):
            check(outs[r], xs[2 + r % 2], f"group broadcast rank {r}", exact=True)

    # In-place form writes into non-contiguous tensors; torch.distributed's ReduceOp is accepted.
    xs = inputs((6, 4), torch.float32)
    ts = to_devices(xs, contiguous=False)
    xc.all_reduce_(ts, torch.distributed.ReduceOp.MAX if torch.distributed.is_available() else "max")
    for t in ts:
        check(t, reduce_ref(xs, "max"), "all_reduce_ in place")
    print("ok semantics")
    """
)

CACHE_AND_ERRORS = PRELUDE + textwrap.dedent(
    r"""
    # The same collective twice compiles once; another shape compiles again.
    xs = inputs((11,), torch.float32)
    xc.all_reduce(to_devices(xs))
    torch_pjrt.sync()
    before = torch_pjrt.metrics()
    out = xc.all_reduce(to_devices(xs))
    check(out[0], reduce_ref(xs, "sum"), "second run")
    after = torch_pjrt.metrics()
    assert after["compiles"] == before["compiles"], (before["compiles"], after["compiles"])
    assert after["collectives_in_xla"] == before["collectives_in_xla"] + 1
    assert after["collective_bytes"] == before["collective_bytes"] + N * 11 * 4, after["collective_bytes"]
    xc.all_reduce(to_devices(inputs((12,), torch.float32)))
    assert torch_pjrt.metrics()["compiles"] > after["compiles"]
    # A subset of the devices (in another order) is its own program and still correct.
    sub = xc.all_gather([xs[1].to(DEV[1]), xs[0].to(DEV[0])])
    check(sub[0], torch.cat([xs[1], xs[0]]), "device subset", exact=True)
    torch.tpu.synchronize()
    print("ok cache")

    def raises(exc, needle, fn):
        try:
            fn()
        except exc as e:
            assert needle in str(e), (needle, str(e))
            return
        raise AssertionError(f"no {exc.__name__} ({needle})")

    t0 = torch.ones(4, device=DEV[0])
    t1 = torch.ones(4, device=DEV[1])
    raises(ValueError, "each participant needs its own device", lambda: xc.all_reduce([t0, t0.clone()]))
    raises(ValueError, "shape", lambda: xc.all_reduce([t0, torch.ones(5, device=DEV[1])]))
    raises(ValueError, "dtype", lambda: xc.all_reduce([t0, t1.double()]))
    raises(ValueError, "not a tpu tensor", lambda: xc.all_reduce([t0, torch.ones(4)]))
    raises(ValueError, "AVG", lambda: xc.all_reduce([t0.long(), t1.long()], "avg"))
    raises(ValueError, "unsupported reduce op", lambda: xc.all_reduce([t0, t1], "xor"))
    if torch.distributed.is_available():
        RO = torch.distributed.ReduceOp
        raises(ValueError, "unsupported reduce op", lambda: xc.all_reduce([t0, t1], RO.BAND))
        for op, name in ((RO(RO.MIN), "min"), (RO.PRODUCT, "prod"), (RO.AVG, "avg")):
            check(xc.all_reduce([t0 * 3, t1 * 2], op)[1], reduce_ref([torch.ones(4) * 3, torch.ones(4) * 2], name),
                  f"ReduceOp {name}")
    raises(ValueError, "not divisible", lambda: xc.reduce_scatter([torch.ones(3, device=d) for d in DEV[:2]]))
    raises(ValueError, "once", lambda: xc.collective_permute([t0, t1], [(0, 1), (0, 0)]))
    raises(ValueError, "0-d", lambda: xc.all_gather([torch.tensor(1.0, device=d) for d in DEV[:2]]))
    raises(IndexError, "out of range", lambda: xc.all_gather([t0, t1], dim=2))
    if N == 4:
        raises(ValueError, "exactly once", lambda: xc.all_reduce(to_devices(inputs((2,), torch.float32)),
                                                                 groups=[[0, 1], [1, 2]]))
    print("ok errors")
    """
)

THREADS = PRELUDE + textwrap.dedent(
    r"""
    # Thread ranks: fn(rank) on tpu:rank; torch.distributed-style calls meet in-process.
    torch.manual_seed(0)
    xs = inputs((5, 3), torch.float32)
    model = torch.nn.Linear(3, 2)

    def step(rank):
        assert torch.tpu.current_device() == rank
        x = xs[rank].to(DEV[rank])
        m = torch.nn.Linear(3, 2).to(DEV[rank])
        m.load_state_dict(model.state_dict())
        m(x).square().sum().backward()
        for p in m.parameters():  # DDP-style gradient average
            xc.rank_all_reduce(p.grad, "avg")
        gathered = xc.rank_all_gather(x)
        w = m.weight.detach().clone()
        xc.rank_broadcast(w, src=N - 1)
        return [p.grad.cpu() for p in m.parameters()], gathered.cpu(), w.cpu()

    results = xc.run_in_threads(step, N)
    grads = []
    for x in xs:
        m = torch.nn.Linear(3, 2)
        m.load_state_dict(model.state_dict())
        m(x).square().sum().backward()
        grads.append([p.grad for p in m.parameters()])
    want = [torch.stack([g[i] for g in grads]).mean(0) for i in range(2)]
    for rank, (got, gathered, w) in enumerate(results):
        for a, b in zip(got, want):
            check(a, b, f"thread rank {rank} grad")
        check(gathered, torch.cat(xs), f"thread rank {rank} gather", exact=True)
        check(w, model.weight.detach(), f"thread rank {rank} broadcast", exact=True)
    print("ok threads")

    # A rank that raises: the others stop with an error naming the collective instead of hanging.
    def one_fails(rank):
        if rank == 1:
            raise KeyError("rank one broke")
        xc.rank_all_reduce(torch.ones(2, device=DEV[rank]))
    start = time.time()
    try:
        xc.run_in_threads(one_fails, N, timeout=30)
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "rank 1" in str(e) and "rank one broke" in str(e), str(e)
    assert time.time() - start < 20, time.time() - start

    # A rank that never arrives: the others time out naming it.
    def one_skips(rank):
        if rank != 0:
            xc.rank_all_reduce(torch.ones(2, device=DEV[rank]))
    try:
        xc.run_in_threads(one_skips, N, timeout=1.0)
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "all_reduce" in str(e) and "timed out" in str(e) and "[0]" in str(e), str(e)

    # Ranks that disagree on the collective all raise.
    def mismatch(rank):
        t = torch.ones(2, device=DEV[rank])
        xc.rank_all_reduce(t, "sum" if rank else "max")
    try:
        xc.run_in_threads(mismatch, N, timeout=30)
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "disagree" in str(e), str(e)
    try:
        xc.run_in_threads(lambda rank: None, N + 1)
        raise AssertionError("no error")
    except ValueError as e:
        assert "TORCH_PJRT_CPU_DEVICES" in str(e), str(e)
    print("ok thread errors")

    # Threads issuing list collectives over overlapping devices in different orders at once: the plugin would
    # start them in different orders per device and deadlock (XLA aborts after 40 s); each is correct.
    def worker(order, res):
        a = [torch.full((100,), float(i + 1), device=DEV[i]) for i in order]
        for _ in range(30):
            a = [x * 1.0 for x in xc.all_reduce(a, "avg")]
        res.append((order, [x.cpu() for x in a]))
    orders = [list(range(N)), list(range(N))[::-1], [1, 0], [N - 1, 0]]
    res = []
    threads = [threading.Thread(target=worker, args=(o, res)) for o in orders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(res) == len(orders), res
    for order, outs in res:
        for x in outs:
            check(x, torch.full((100,), sum(i + 1 for i in order) / len(order)), f"concurrent {order}")
    print("ok concurrent")
    """
)

DISK_CACHE = PRELUDE + textwrap.dedent(
    r"""
    # A replicated executable from the disk tier keeps its device assignment (replica i on the i-th device given).
    xs = inputs((4,), torch.float32)
    devices = DEV[::-1][:3]
    out = xc.all_gather([x.to(d) for x, d in zip(xs, devices)])
    for o, d in zip(out, devices):
        assert o.device == torch.device(d)
        check(o, torch.cat(xs[:3]), "gather through the disk cache", exact=True)
    m = torch_pjrt.metrics()
    print("compiles", m["compiles"], "disk hits", m["disk_cache_hits"])
    """
)


def run_script(script: str, devices: int) -> str:
    env = dict(os.environ, TORCH_PJRT_CPU_DEVICES=str(devices))
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    r = subprocess.run([sys.executable, "-c", script, str(devices)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout


@pytest.mark.parametrize("devices", [2, 4])
def test_collectives_match_reference(devices):
    out = run_script(COLLECTIVES, devices)
    assert "ok dtypes" in out and "ok semantics" in out, out


@pytest.mark.parametrize("devices", [2, 4])
def test_compiles_once_metrics_and_errors(devices):
    out = run_script(CACHE_AND_ERRORS, devices)
    assert "ok cache" in out and "ok errors" in out, out


@pytest.mark.parametrize("devices", [2, 4])
def test_thread_ranks(devices):
    out = run_script(THREADS, devices)
    assert "ok threads" in out and "ok thread errors" in out and "ok concurrent" in out, out


def test_disk_cache_keeps_the_device_assignment(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_PJRT_CACHE_DIR", str(tmp_path))
    first = run_script(DISK_CACHE, 4)
    second = run_script(DISK_CACHE, 4)
    assert "compiles 1 disk hits 0" in first, first
    assert "compiles 0 disk hits 1" in second, second


def test_one_device_is_the_identity():
    # In this process (one device): a one-replica collective returns the input's values.
    import torch
    from torch_pjrt import _xla_collectives as xc

    x = torch.randn(3, 4)
    t = x.to("tpu").t()
    for out in (xc.all_reduce([t])[0], xc.all_gather([t])[0], xc.broadcast([t])[0]):
        assert out.device.type == "tpu" and torch.equal(out.cpu(), x.t())
