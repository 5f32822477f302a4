"""Pinned host memory for tpu and non_blocking host->device copies, against the CPU values."""
import pytest
import torch

import torch_pjrt

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def sample(dtype, shape=(33, 17)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def test_pin_memory_makes_a_pinned_copy():
    x = sample(torch.float32)
    p = x.pin_memory()
    assert p.is_pinned() and not x.is_pinned()
    assert p.device.type == "cpu" and torch.equal(p, x)
    assert p.data_ptr() != x.data_ptr()
    assert p.untyped_storage().data_ptr() % 4096 == 0  # page-aligned
    assert p[3:].is_pinned() and p.t().is_pinned()  # views share the pinned storage
    assert p.pin_memory().is_pinned()
    assert not x.to("tpu").is_pinned()
    assert not p.clone().is_pinned()


@pytest.mark.parametrize("shape", [(0,), (), (5,)])
def test_pin_memory_of_small_and_empty_tensors(shape):
    x = torch.ones(shape)
    p = x.pin_memory()
    assert p.is_pinned() and torch.equal(p, x)
    torch.testing.assert_close(p.to("tpu", non_blocking=True).cpu(), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_blocking_copy_from_pinned_reads_right_values(dtype):
    x = sample(dtype)
    d = x.pin_memory().to("tpu", non_blocking=True)
    assert d.device.type == "tpu" and d.dtype == dtype
    assert torch.equal(d.cpu(), x)  # reading waits for the transfer
    if dtype.is_floating_point:
        torch.testing.assert_close((d * 2 + 1).cpu(), x * 2 + 1)


def test_source_may_change_after_synchronize():
    x = sample(torch.float32, (256, 256))
    p = x.pin_memory()
    d = p.to("tpu", non_blocking=True)
    e = torch.empty_like(p, device="tpu").copy_(p, non_blocking=True)
    torch.tpu.synchronize()
    p.fill_(-1.0)
    assert torch.equal(d.cpu(), x) and torch.equal(e.cpu(), x)


def test_source_freed_right_after_the_copy():
    x = sample(torch.float32, (512, 128))
    p = x.pin_memory()
    d = p.to("tpu", non_blocking=True)
    del p  # the copy keeps the host memory alive until the transfer is done
    junk = [torch.full((512, 128), 9.0).pin_memory() for _ in range(4)]  # may reuse freed memory
    assert torch.equal(d.cpu(), x)
    assert all(j.is_pinned() for j in junk)


def test_many_copies_in_flight_then_synchronize():
    xs = [sample(torch.float32, (64, 64)) + i for i in range(20)]
    ds = [x.pin_memory().to("tpu", non_blocking=True) for x in xs]
    torch.tpu.synchronize()
    for d, x in zip(ds, xs):
        assert torch.equal(d.cpu(), x)


@pytest.mark.parametrize("case", ["pageable", "non_contiguous", "slice", "cast", "into_view"])
def test_other_non_blocking_copies_stay_correct(case):
    x = sample(torch.float32, (16, 12))
    if case == "pageable":
        d = x.to("tpu", non_blocking=True)
        expected = x
    elif case == "non_contiguous":
        d = x.pin_memory().t().to("tpu", non_blocking=True)
        expected = x.t()
    elif case == "slice":
        d = x.pin_memory()[4:9].to("tpu", non_blocking=True)
        expected = x[4:9]
    elif case == "cast":
        d = x.pin_memory().to("tpu", dtype=torch.float64, non_blocking=True)
        expected = x.double()
    else:
        d = torch.zeros(20, 12, device="tpu")
        d[2:18].copy_(x.pin_memory(), non_blocking=True)
        expected = torch.zeros(20, 12)
        expected[2:18] = x
    assert torch.equal(d.cpu(), expected)


def test_non_blocking_copy_after_pending_writes_to_the_same_storage():
    # Fused/lazy modes record `d.add_` into a graph; the upload must land after it.
    d = torch.zeros(8, 8, device="tpu")
    d.add_(5)
    x = sample(torch.float32, (8, 8))
    d.copy_(x.pin_memory(), non_blocking=True)
    d.mul_(2)
    assert torch.equal(d.cpu(), x * 2)


def test_data_loader_pin_memory_batches_match_cpu():
    g = torch.Generator().manual_seed(3)
    features, labels = torch.randn(37, 5, generator=g), torch.randint(0, 4, (37,), generator=g)
    ds = torch.utils.data.TensorDataset(features, labels)
    pinned = torch.utils.data.DataLoader(ds, batch_size=8, pin_memory=True)
    plain = torch.utils.data.DataLoader(ds, batch_size=8)
    w = torch.randn(5, 4, generator=g)
    wt = w.to("tpu")
    count = 0
    for (xp, yp), (xc, yc) in zip(pinned, plain):
        assert xp.is_pinned() and yp.is_pinned()
        xd, yd = xp.to("tpu", non_blocking=True), yp.to("tpu", non_blocking=True)
        loss = torch.nn.functional.cross_entropy(xd @ wt, yd)
        assert torch.equal(xd.cpu(), xc) and torch.equal(yd.cpu(), yc)
        torch.testing.assert_close(loss.cpu(), torch.nn.functional.cross_entropy(xc @ w, yc))
        count += 1
    assert count == 5


def test_data_loader_with_workers_and_pin_memory():
    ds = torch.utils.data.TensorDataset(torch.arange(24.0).reshape(12, 2))
    dl = torch.utils.data.DataLoader(ds, batch_size=4, pin_memory=True, num_workers=2,
                                     multiprocessing_context="spawn")
    batches = [b.to("tpu", non_blocking=True) for (b,) in dl]
    torch.tpu.synchronize()
    assert torch.equal(torch.cat([b.cpu() for b in batches]), torch.arange(24.0).reshape(12, 2))


def test_host_to_device_bytes_are_counted():
    torch_pjrt.reset_metrics()
    x = torch.ones(1000).pin_memory()
    x.to("tpu", non_blocking=True)
    torch.tpu.synchronize()
    assert torch_pjrt.metrics()["host_to_device_bytes"] >= 4000


def test_pinned_copies_take_the_asynchronous_path():
    from torch_pjrt import _C
    torch.tpu.synchronize()
    assert _C._pending_host_transfers() == 0
    torch.ones(1000).to("tpu", non_blocking=True)  # pageable: a blocking upload, nothing held
    assert _C._pending_host_transfers() == 0
    p = torch.ones(1000).pin_memory()
    d = p.to("tpu", non_blocking=True)
    assert _C._pending_host_transfers() == 1  # the source is held until its transfer is done
    p.to("tpu")  # non_blocking=False waits
    assert _C._pending_host_transfers() == 1
    torch.tpu.synchronize()
    assert _C._pending_host_transfers() == 0
    assert torch.equal(d.cpu(), torch.ones(1000))


def test_forked_workers_read_and_free_inherited_pinned_tensors():
    # After the runtime started, fork()ed workers are bad forks for device work,
    # but pinned tensors are host memory: reading and freeing them is CPU work.
    torch.ones(1, device="tpu").cpu()
    data = torch.arange(40.0).reshape(20, 2).pin_memory()

    class Pinned(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            copy = data.clone().pin_memory()  # allocate and free pinned memory in the worker
            return copy[i].clone()

    dl = torch.utils.data.DataLoader(Pinned(), batch_size=5, pin_memory=True, num_workers=2,
                                     multiprocessing_context="fork")
    out = torch.cat([b.to("tpu", non_blocking=True).cpu() for b in dl])
    assert torch.equal(out, torch.arange(40.0).reshape(20, 2))


# ---- device -> host: non_blocking reads into pinned memory return once launched (as CUDA's do)

def slow_result(n=768, rounds=24):
    """A tpu tensor whose programs take a good while on the CPU plugin (about a second on 2 cores)."""
    x = torch.rand(n, n, generator=torch.Generator().manual_seed(1)).to("tpu")
    for _ in range(rounds):
        x = torch.tanh(x @ x / n)
    return x


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_blocking_read_into_pinned_memory_is_right_after_synchronize(dtype):
    x = sample(dtype)
    out = torch.empty(x.shape, dtype=dtype).pin_memory()
    out.copy_(x.to("tpu") * 1, non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(out, x)


def test_non_blocking_read_returns_before_the_work_is_done_and_an_event_orders_it():
    if torch_pjrt.platform()["name"] != "cpu":
        pytest.skip("the slow program is slow on the CPU plugin only")
    if torch_pjrt.get_mode() == "debug":
        pytest.skip("debug mode waits for every program and read as it launches them")
    # The first run of a new graph waits for its completion (fused_graph.cpp, run_graph): run the same graph
    # (its result kept, as below) and read once before, so that the read below is launched without waiting.
    out = torch.zeros(768, 768).pin_memory()
    out.copy_(slow_result(), non_blocking=True)
    torch.tpu.synchronize()
    x = slow_result()
    out.copy_(x, non_blocking=True)
    stream = torch.tpu.current_stream()
    assert not stream.query()  # the read did not wait for the programs before it
    done = torch.Event(device="tpu")
    done.record()
    done.synchronize()
    assert stream.query()
    assert torch.equal(out, x.cpu())


def test_to_cpu_non_blocking_gives_a_pinned_tensor_read_asynchronously():
    x = slow_result(rounds=2)
    host = x.to("cpu", non_blocking=True)
    torch.tpu.synchronize()
    assert torch.equal(host, x.cpu())


def test_pageable_memory_and_views_are_read_at_once():
    x = sample(torch.float32).to("tpu")
    pageable = torch.empty(33, 17)
    pageable.copy_(x, non_blocking=True)  # nothing to synchronize: like CUDA, a pageable read is synchronous
    assert torch.equal(pageable, x.cpu())
    pinned = torch.empty(17, 33).pin_memory()
    pinned.copy_(x.t(), non_blocking=True)  # a view is gathered by a program, then read
    torch.tpu.synchronize()
    assert torch.equal(pinned, x.cpu().t())


def test_host_tensor_dropped_before_the_read_is_done():
    x = slow_result(rounds=4)
    for _ in range(3):
        torch.empty(x.shape).pin_memory().copy_(x, non_blocking=True)  # freed by the user at once: held until read
    torch.tpu.synchronize()
    assert torch.isfinite(x.cpu()).all()
