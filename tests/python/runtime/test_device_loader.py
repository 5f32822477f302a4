"""torch_pjrt.DeviceLoader against the plain loop that copies each batch with .to("tpu")."""
import collections
import copy
import dataclasses
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import torch_pjrt
from torch_pjrt import DeviceLoader

DEVICE = torch.device("tpu", 0)


def plain_to_device(data):
    """The reference: the loop a user writes without DeviceLoader."""
    if isinstance(data, torch.Tensor):
        return data.to("tpu")
    if isinstance(data, dict):
        return {k: plain_to_device(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(plain_to_device(v) for v in data)
    return data


def assert_same_batch(actual, expected):
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.device == DEVICE and actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual.cpu(), expected.cpu())
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same_batch(actual[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same_batch(a, e)
    else:
        assert actual == expected


def dataset(n=22):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def shuffled_loader(**kwargs):
    return DataLoader(dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1), **kwargs)


def started_since(before):
    """The live threads not in `before` (threads other tests left may end meanwhile)."""
    return [t for t in threading.enumerate() if t not in before]


def wait_for_threads(before, timeout=10.0):
    """The threads started since `before` that are still alive after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while started_since(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return started_since(before)


def test_same_batches_as_plain_loop_every_epoch():
    loader = DeviceLoader(shuffled_loader())
    plain = shuffled_loader()
    assert len(loader) == len(plain) == 6
    for _ in range(2):  # a second pass reshuffles, as the plain loader does
        got = list(loader)
        expected = [plain_to_device(b) for b in plain]
        assert len(got) == len(expected)
        for a, e in zip(got, expected):
            assert_same_batch(a, e)


def train(batches, model, optimizer):
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_matches_plain_loop_and_cpu():
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def run(device, batches):
        model = copy.deepcopy(cpu_model).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return train(batches, model, optimizer), [p.detach().cpu() for p in model.parameters()]

    loader_losses, loader_params = run("tpu", DeviceLoader(shuffled_loader()))
    plain_losses, plain_params = run("tpu", (plain_to_device(b) for b in shuffled_loader()))
    cpu_losses, cpu_params = run("cpu", shuffled_loader())
    assert len(loader_losses) == 6
    assert loader_losses == plain_losses  # the same programs on the same data
    for a, p in zip(loader_params, plain_params):
        assert torch.equal(a, p)
    torch.testing.assert_close(torch.tensor(loader_losses), torch.tensor(cpu_losses), atol=1e-5, rtol=1e-5)
    for a, c in zip(loader_params, cpu_params):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


Pair = collections.namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass(frozen=True)
class Sample:
    features: torch.Tensor
    name: str
    extra: dict = dataclasses.field(default_factory=dict)


def test_nested_structures_move_every_tensor_and_keep_the_rest():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 4, generator=g)
    on_device = torch.arange(3.0).to("tpu")
    batch = {
        "pair": Pair(base[:2], torch.tensor([True, False])),
        "list": [base.t(), torch.empty(0, 3), 7, "text", None],  # a transposed view, an empty tensor
        "tuple": (base[1:3].pin_memory(), torch.randint(-5, 5, (4,), dtype=torch.int8, generator=g)),
        "sample": Sample(base * 2, "a", {"ids": torch.arange(4)}),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "already": on_device,
        "bytes": b"raw",
    }
    source = [batch, batch]
    got = list(DeviceLoader(source))
    assert len(got) == 2
    for moved in got:
        assert list(moved) == list(batch)
        assert isinstance(moved["pair"], Pair)
        assert_same_batch(tuple(moved["pair"]), tuple(plain_to_device(tuple(batch["pair"]))))
        assert_same_batch(moved["list"], plain_to_device(batch["list"]))
        assert moved["list"][0].stride() == batch["list"][0].stride()  # like .to("tpu")
        assert_same_batch(moved["tuple"], plain_to_device(batch["tuple"]))
        sample = moved["sample"]
        assert isinstance(sample, Sample) and sample.name == "a"
        assert_same_batch(sample.features, batch["sample"].features)
        assert_same_batch(sample.extra, plain_to_device(batch["sample"].extra))
        assert_same_batch(moved["scalar"], batch["scalar"])
        assert moved["already"] is on_device
        assert moved["bytes"] == b"raw"
    # The loader's batch itself is untouched.
    assert batch["sample"].features.device.type == "cpu" and batch["pair"].left.device.type == "cpu"


def test_a_pinned_buffer_the_loader_reuses_is_read_before_it_changes():
    buffer = torch.zeros(512, 512).pin_memory()

    def reusing_loader():
        for i in range(16):
            buffer.fill_(float(i))  # the next batch overwrites the last one's memory
            yield buffer

    got = list(DeviceLoader(reusing_loader(), prefetch=3))
    for i, batch in enumerate(got):
        assert torch.equal(batch.cpu(), torch.full((512, 512), float(i)))


class Counting:
    """An iterable that counts the batches taken from it."""

    def __init__(self, n, delay=0.0):
        self.n, self.delay, self.taken = n, delay, 0

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.delay)
            self.taken += 1
            yield torch.full((8,), float(i))


def test_prefetch_runs_ahead_but_is_bounded():
    source = Counting(50)
    it = iter(DeviceLoader(source, prefetch=2))
    first = next(it)
    deadline = time.monotonic() + 5
    while source.taken < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    # One consumed, two queued, one uploaded and waiting for room.
    assert source.taken == 4
    assert torch.equal(first.cpu(), torch.zeros(8))
    assert [next(it).cpu()[0].item() for _ in range(3)] == [1.0, 2.0, 3.0]
    it.close()


def test_early_break_leaves_no_thread():
    baseline = set(threading.enumerate())
    source = Counting(100)
    loader = DeviceLoader(source, prefetch=2)
    for i, batch in enumerate(loader):
        assert len(started_since(baseline)) == 1
        if i == 1:
            break
    assert started_since(baseline) == []  # the iterator was dropped: its thread joined
    assert source.taken <= 2 + 2 + 1
    it = iter(loader)
    next(it)
    del it
    assert started_since(baseline) == []
    it = iter(loader)
    it.close()
    assert started_since(baseline) == []
    with pytest.raises(StopIteration):
        next(it)


def test_early_break_with_workers_shuts_them_down():
    baseline = set(threading.enumerate())
    loader = DeviceLoader(DataLoader(dataset(64), batch_size=2, num_workers=2, multiprocessing_context="fork"))
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert wait_for_threads(baseline) == []
    import multiprocessing
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


class FailingDataset(Dataset):
    def __init__(self, bad_index):
        self.bad_index = bad_index

    def __len__(self):
        return 12

    def __getitem__(self, i):
        if i == self.bad_index:
            raise ValueError(f"sample {i} is corrupt")
        return torch.full((3,), float(i))


@pytest.mark.modes_inside  # worker errors and fork order are the loader's and the runtime start's, not the
# mode's (fork under each mode: test_threads_fork.py): once per `make test`
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_error_is_raised_at_its_batch(workers):
    baseline = set(threading.enumerate())
    loader = DeviceLoader(DataLoader(FailingDataset(7), batch_size=2, num_workers=workers,
                                     multiprocessing_context="fork" if workers else None))
    it = iter(loader)
    got = [next(it), next(it), next(it)]  # samples 0-5
    with pytest.raises(ValueError, match="sample 7 is corrupt"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    for i, batch in enumerate(got):
        assert torch.equal(batch.cpu(), torch.tensor([[2.0 * i] * 3, [2.0 * i + 1] * 3]))
    del it
    # DataLoader's re-raised error references its iterator through a cycle (as in a
    # plain loop): the collector frees it, and the workers' queue threads end.
    gc.collect()
    assert wait_for_threads(baseline) == []


class WorkerDataset(Dataset):
    """Each sample says whether it was made in a forked worker that may not touch the device."""

    def __len__(self):
        return 20

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        assert info is not None, "expected to run in a worker"
        # A worker forked after the runtime started: any device use there raises.
        return torch.full((4,), float(i)), torch.tensor(torch.tpu._is_in_bad_fork())


@pytest.mark.parametrize("pin_memory", [False, True])
def test_forked_workers_do_cpu_work_only(pin_memory):
    torch.ones(1, device="tpu").cpu()  # the runtime runs before the fork
    make = lambda: DataLoader(WorkerDataset(), batch_size=3, num_workers=2, pin_memory=pin_memory,
                              multiprocessing_context="fork")
    got = list(DeviceLoader(make()))
    expected = [plain_to_device(b) for b in make()]
    assert len(got) == len(expected) == 7
    for (x, in_bad_fork), e in zip(got, expected):
        assert bool(in_bad_fork.all().item())
        assert_same_batch(x, e[0])


FRESH_PROCESS = """
import torch, torch_pjrt
from torch.utils.data import DataLoader, Dataset

class Flags(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        assert torch.utils.data.get_worker_info() is not None
        return torch.tensor(torch.tpu._is_in_bad_fork())

# DeviceLoader is the first device use: it starts the runtime before the workers fork.
loader = torch_pjrt.DeviceLoader(DataLoader(Flags(), batch_size=2, num_workers=2, multiprocessing_context="fork"))
flags = [bool(b.all().item()) for b in loader]
print("FLAGS", flags)
"""


@pytest.mark.modes_inside  # worker errors and fork order are the loader's and the runtime start's, not the
# mode's (fork under each mode: test_threads_fork.py): once per `make test`
def test_workers_fork_after_the_runtime_started_in_a_fresh_process():
    """Workers forked before the runtime started would each start a PJRT client (torch.manual_seed seeds
    every device): DeviceLoader starts the runtime first, so workers cannot touch the device."""
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FLAGS [True, True, True]" in result.stdout, result.stdout + result.stderr[-3000:]


def test_distributed_sampler_epochs_pass_through():
    data = dataset(30)

    def make():
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=5))

    loader, plain = DeviceLoader(make()), make()
    assert loader.sampler is loader.loader.sampler and loader.dataset is data
    assert len(loader) == len(plain) == 4
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        plain.sampler.set_epoch(epoch)
        got = list(loader)
        for a, e in zip(got, [plain_to_device(b) for b in plain]):
            assert_same_batch(a, e)
        epochs.append(torch.cat([y.cpu() for _, y in got]))
    assert not torch.equal(epochs[0], epochs[1])  # set_epoch reshuffled


def test_bad_arguments_and_len_without_one():
    with pytest.raises(ValueError, match="prefetch"):
        DeviceLoader([], prefetch=0)
    with pytest.raises(ValueError, match="prefetch"):
        DeviceLoader([], prefetch=True)
    with pytest.raises(ValueError, match="tpu device"):
        DeviceLoader([], device="cpu")
    with pytest.raises(ValueError, match="does not exist"):
        iter(DeviceLoader([], device=torch.device("tpu", torch.tpu.device_count())))
    with pytest.raises(TypeError, match="iterable"):
        DeviceLoader(42)
    with pytest.raises(TypeError, match="no len"):
        len(DeviceLoader(iter([torch.ones(1)])))
    assert [b.cpu().item() for b in DeviceLoader(iter([torch.ones(1)]))] == [1.0]
    assert "DeviceLoader" in torch_pjrt.__all__
