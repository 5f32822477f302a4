"""Single-process pieces FSDP2 and DTensor rely on, each against the same code on the CPU.

FSDP2 builds modules on the meta device and materializes them with
`to_empty(device=...)`; it frees an unsharded parameter's memory with
`untyped_storage().resize_(0)` after forward and reallocates it with
`resize_(n)` before the next all-gather, whose flat output it splits into the
parameters (`split_with_sizes_copy`, `as_strided`, `set_`). Ops recorded in a
fused graph before such a resize must still see the old data.
The multi-process checks are in test_fsdp_dtensor.py.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import torch_pjrt
from conftest import DEVICE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "dist_scripts"))
import fsdp_models as M  # noqa: E402

pytestmark = pytest.mark.modes_inside  # runs its modes itself: once per `make test`

MODES = ["fused", "strict", "lazy", "debug"]


@pytest.fixture(params=MODES)
def mode(request):
    with torch_pjrt.mode(request.param):
        yield request.param


def on_both(fn, *args):
    """fn(device, *args) on the CPU and on tpu; every returned tensor agrees."""
    expected, actual = fn("cpu", *args), fn(DEVICE, *args)
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        assert a.device.type == DEVICE
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-6)


def buffer_address(t):
    torch_pjrt.sync()
    return torch_pjrt._C._storage_buffer_address(t)


def test_meta_init_to_empty(mode):
    with torch.device("meta"):
        model = M.make("attn")
    model.to_empty(device=DEVICE)
    assert all(p.device.type == DEVICE for p in model.parameters())
    for layer in model.modules():  # device-side init runs (the device RNG, not the CPU's stream)
        if isinstance(layer, nn.Linear):
            layer.reset_parameters()
            bound = layer.weight.shape[1] ** -0.5
            w = layer.weight.detach().cpu()
            assert 0 < w.abs().max() <= bound and w.std() > bound / 4
    model.load_state_dict(M.initial_state("attn"))
    reference = M.make("attn")
    reference.load_state_dict(M.initial_state("attn"))
    x, y = M.batches("attn", 2)[0]
    for m, dev in ((reference, "cpu"), (model, DEVICE)):
        M.loss_fn(m(x.to(dev)), y.to(dev)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-4, atol=1e-6, msg=name)


def fsdp_storage_cycle(device):
    """FSDP2's unshard/reshard cycle on one flat all-gather buffer and two parameter views."""
    torch.manual_seed(0)
    shards = [torch.randn(20).to(device) for _ in range(2)]
    x = torch.randn(3, 4).to(device)
    flat = torch.empty(20, device=device)
    weight = torch.as_strided(flat, (4, 4), (4, 1), 0)  # unsharded parameters: views of the flat output
    bias = torch.as_strided(flat, (4,), (1,), 16)
    outputs = []
    for shard in shards:
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())  # alloc_storage
        flat.copy_(shard)  # the all-gather's copy-out
        outputs.append(torch.addmm(bias, x, weight))  # forward, recorded in the pending graph
        outputs.append(torch.split(flat, [16, 4])[1] * 2)
        flat.untyped_storage().resize_(0)  # free_storage after forward
        assert flat.untyped_storage().nbytes() == 0
    return outputs


def test_resize_free_and_realloc(mode):
    on_both(fsdp_storage_cycle)


def test_free_and_realloc_do_not_cut_the_fused_graph():
    """FSDP2's frees and reallocations leave the pending graph alone: the whole cycle is one program."""
    with torch_pjrt.mode("fused"):
        torch_pjrt.sync()
        before = torch_pjrt.metrics()["graphs"]
        outputs = fsdp_storage_cycle(DEVICE)
        assert torch_pjrt.metrics()["graphs"] == before  # nothing ran yet
        expected = fsdp_storage_cycle("cpu")
        for e, a in zip(expected, outputs):
            torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-6)
        assert torch_pjrt.metrics()["graphs"] == before + 1


def test_freed_storage_is_no_graph_output():
    with torch_pjrt.mode("fused"):
        t = torch.arange(8.0, device=DEVICE)
        t.mul_(2)  # written by the pending graph
        y = t + 1
        t.untyped_storage().resize_(0)
        torch.testing.assert_close(y.cpu(), torch.arange(8.0) * 2 + 1)
        assert t.untyped_storage().nbytes() == 0 and buffer_address(t) == 0


def test_realloc_at_another_size_runs_the_graph_first(mode):
    def cycle(device):
        t = torch.arange(8.0).to(device)
        y = t * 3  # recorded while t has 32 bytes
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(4 * 4)  # smaller than the graph knows it
        small = torch.empty(0, device=device).set_(t.untyped_storage(), 0, (4,), (1,))
        small.copy_(torch.full((4,), 5.0))
        return [y, small * 1]
    on_both(cycle)


def test_resize_to_zero_frees_the_buffer(mode):
    t = torch.arange(8.0, device=DEVICE) + 1
    assert buffer_address(t) != 0
    before = torch.tpu.memory_allocated()
    t.untyped_storage().resize_(0)
    assert buffer_address(t) == 0
    assert torch.tpu.memory_allocated() == before - 32
    t.untyped_storage().resize_(32)
    t.copy_(torch.full((8,), 3.0))
    assert t.cpu().tolist() == [3.0] * 8


def test_growth_keeps_prefix(mode):
    def grow(device):
        t = torch.arange(6.0).to(device) * 2
        y = t + 1  # recorded before the resize
        t.untyped_storage().resize_(10 * 4)
        full = torch.empty(0, device=device).set_(t.untyped_storage(), 0, (6,), (1,))
        return [y, full.clone()]
    on_both(grow)


def set_and_as_strided(device):
    base = torch.arange(24.0).to(device)
    view = torch.empty(0, device=device)
    view.set_(base.untyped_storage(), 2, (3, 4), (6, 1))  # FSDP2's set_ of a storage slice
    view.mul_(-1)
    strided = base.as_strided((2, 3), (1, 8), 5)
    strided.add_(100)
    return [base, view.clone(), strided.t().contiguous()]


def test_set_and_as_strided(mode):
    on_both(set_and_as_strided)


def split_views_of_flat(device):
    """split/chunk/narrow views of a flat buffer, written by copy_ both ways."""
    flat = torch.empty(30, device=device)
    a, b = torch.split(flat, [12, 18])
    flat.copy_(torch.linspace(-1, 1, 30).to(device))
    first = a.view(3, 4).sum(0)
    torch.chunk(flat, 3)[1].copy_(torch.arange(10.0).to(device))
    flat.narrow(0, 25, 5).fill_(7)
    out = torch.empty(30, device=device)
    torch.split_with_sizes_copy(flat, [12, 18], out=list(torch.split(out, [12, 18])))
    return [first, b.view(3, 6).clone(), flat, out]


def test_split_chunk_narrow(mode):
    on_both(split_views_of_flat)


def test_chunk_cat_into_flat(mode):
    """FSDP2's reduce-scatter input: torch._chunk_cat of uneven gradients into one flat buffer."""
    def chunk_cat(device):
        torch.manual_seed(1)
        grads = [torch.randn(5, 3).to(device), torch.randn(3).to(device)]
        out = torch.empty(2, 11, device=device)  # per grad: ceil(rows / 2) rows of each chunk
        torch._chunk_cat(grads, dim=0, num_chunks=2, out=out)
        return [out]
    on_both(chunk_cat)


DTENSOR_ONE_RANK = r"""
import os, torch, torch_pjrt, torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group(rank=0, world_size=1)
mesh = DeviceMesh("tpu", [0])
torch.manual_seed(0)
x, w = torch.randn(4, 6), torch.randn(6, 3)
d = distribute_tensor(x.to("tpu"), mesh, [Shard(0)])
assert isinstance(d, DTensor) and d.to_local().device.type == "tpu"
checks = {
    "pointwise": ((d * 2 + 1).sum(0).full_tensor(), (x * 2 + 1).sum(0)),
    "replicate": (d.redistribute(mesh, [Replicate()]).to_local(), x),
    "matmul": ((d @ distribute_tensor(w.to("tpu"), mesh, [Replicate()])).full_tensor(), x @ w),
    "softmax": (d.softmax(-1).full_tensor(), x.softmax(-1)),
}
for name, (got, want) in checks.items():
    assert got.device.type == "tpu", name
    torch.testing.assert_close(got.cpu(), want, msg=name)
dist.destroy_process_group()
print("ok", len(checks))
"""


def test_dtensor_one_rank_mesh():
    """DTensor on DeviceMesh("tpu", [0]) with the default (tpu_dist) process group of world size 1."""
    from fsdp_train import free_port
    env = dict(os.environ, PORT=str(free_port()), PYTHONPATH=os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", DTENSOR_ONE_RANK], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and "ok 4" in r.stdout, r.stdout + r.stderr[-4000:]
