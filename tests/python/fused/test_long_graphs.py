"""Long fused graphs: thousands of ops give CPU's values, pass each cached
Scalar buffer once (O(1) program parameters, not two per op), and graphs that
share Scalar operands differently never share a compiled program."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_pjrt

pytestmark = pytest.mark.modes_inside  # every test picks its mode(s): once per `make test`

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # tests/python/<layer>/ -> repo


def chain(x, n):
    for i in range(n):
        x = x + 1 if i % 2 == 0 else x * 1.0001
    return x


def row_loop(x):
    for i in range(x.shape[0]):
        x[i] += 1
    return x


@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_long_chain_matches_cpu(mode):
    base = torch.randn(4)
    expected = chain(base.clone(), 3000)
    with torch_pjrt.mode(mode):
        actual = chain(base.to("tpu"), 3000).cpu()
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_row_slice_loop_matches_cpu(mode):
    base = torch.randn(1024, 8)
    expected = row_loop(base.clone())
    with torch_pjrt.mode(mode):
        actual = row_loop(base.to("tpu")).cpu()
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_copy_between_different_views_of_one_storage_still_copies(mode):
    # copy_ of a view onto itself is skipped; any other view must still copy.
    base = torch.arange(12.0).reshape(3, 4)
    with torch_pjrt.mode(mode):
        x = base.to("tpu")
        x[0].copy_(x[2])
        x[1].copy_(x[1])
        x[:, 3].copy_(x[:, 0])
        actual = x.cpu()
    expected = base.clone()
    expected[0].copy_(expected[2])
    expected[:, 3].copy_(expected[:, 0])
    torch.testing.assert_close(actual, expected)


def program_parameters(dump_dir):
    """Parameter count of every program compiled (from TORCH_PJRT_DUMP_DIR)."""
    counts = []
    for name in os.listdir(dump_dir):
        text = open(os.path.join(dump_dir, name)).read()
        signature = re.search(r"func\.func public @main\((.*?)\) ->", text, re.S)
        if signature:
            counts.append(len(re.findall(r"%arg\d+:", signature.group(1))))
    return counts


def test_long_graph_has_constant_number_of_parameters(tmp_path):
    # A fresh process: TORCH_PJRT_DUMP_DIR is read once per process.
    script = textwrap.dedent("""
        import torch, torch_pjrt
        torch_pjrt.set_mode("lazy")
        x = torch.randn(4).to("tpu")
        for i in range(3000):
            x = x + 1 if i % 2 == 0 else x * 1.0001
        y = torch.randn(256, 8).to("tpu")
        for i in range(256):
            y[i] += 1
        torch_pjrt.sync()
        print(x.sum().item(), y.sum().item())
    """)
    env = dict(os.environ, TORCH_PJRT_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.path.join(REPO, "python") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, timeout=600)
    counts = program_parameters(tmp_path)
    assert counts, "no program was dumped"
    # The graph of 3000 chained ops and 256 row updates: the two storages,
    # the distinct Scalars (1, 1.0001, alpha=1) and the 255 distinct nonzero
    # row offsets (runtime operands), not two parameters per op.
    assert max(counts) <= 6 + 255, counts


@pytest.mark.parametrize("mode", ["fused", "lazy"])
def test_graphs_sharing_scalars_differently_do_not_collide(mode):
    # Same ops and signatures; in the first graph both Scalars are 2.5 (one
    # cached buffer, one parameter), in the second they differ (two).
    base = torch.randn(5)
    with torch_pjrt.mode(mode):
        results = []
        for a, b in [(2.5, 2.5), (2.5, 4.0), (3.0, 3.0), (-1.0, 7.0)]:
            x = base.to("tpu")
            results.append(((x + a) * b).cpu())
    for (a, b), actual in zip([(2.5, 2.5), (2.5, 4.0), (3.0, 3.0), (-1.0, 7.0)], results):
        torch.testing.assert_close(actual, (base + a) * b)


def test_graphs_of_expensive_ops_are_cut_by_compile_cost():
    """PyTorch's batch-vs-slicing pattern: one complex acos per row of a 512-row tensor. Complex acos costs
    XLA ~25x a cheap op to compile, so the graph is cut by compile cost long before the op limit, and the
    equal middle pieces share one program: 3 compiles instead of one program with 512 acos expansions."""
    x = torch.randn(512, 16, dtype=torch.complex64)
    expected = torch.stack([torch.acos(row) for row in x])
    with torch_pjrt.mode("fused"):
        torch_pjrt.sync()
        before = torch_pjrt.metrics()
        rows = [torch.acos(row) for row in x.to("tpu")]
        actual = torch.stack(rows).cpu()
        after = torch_pjrt.metrics()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert after["graphs"] - before["graphs"] >= 3
    assert after["compiles"] - before["compiles"] <= 4
    # Cheap ops stay in one graph: 1000 adds cost far less than the limit.
    with torch_pjrt.mode("fused"):
        torch_pjrt.sync()
        graphs = torch_pjrt.metrics()["graphs"]
        y = torch.zeros(4, device="tpu")
        for _ in range(1000):
            y = y + 1
        assert y.cpu().tolist() == [1000.0] * 4
        assert torch_pjrt.metrics()["graphs"] == graphs + 1
