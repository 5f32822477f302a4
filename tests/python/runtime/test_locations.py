"""Every op in a program carries its location (the ATen op at the user's
file:line): program dumps show it, and a compile error that names a line is
pinned to its op without compiling graph prefixes."""
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import torch_pjrt

pytestmark = pytest.mark.modes_inside

HERE = os.path.dirname(os.path.abspath(__file__))


def dump_workload():
    """Run by the child process of test_dumps_name_the_op_and_the_users_line (in the mode it was given)."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to("tpu")
    y = x + 1; add_line = inspect.currentframe().f_lineno  # noqa: E702
    s = torch.sort(y, dim=1, descending=True).values; sort_line = inspect.currentframe().f_lineno  # noqa: E702
    out = s.sum(dim=0).cpu()
    torch.testing.assert_close(out, torch.sort(torch.arange(12.0).reshape(3, 4) + 1, 1, True).values.sum(0))
    return add_line, sort_line


@pytest.mark.parametrize("mode", ["fused", "strict"])
def test_dumps_name_the_op_and_the_users_line(tmp_path, mode):
    code = (f"import sys, json; sys.path.insert(0, {HERE!r}); import test_locations as t; "
            "print(json.dumps(t.dump_workload()))")
    env = dict(os.environ, TORCH_PJRT_DUMP_DIR=str(tmp_path), TORCH_PJRT_MODE=mode,
               PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    add_line, sort_line = json.loads(out.stdout.strip().splitlines()[-1])
    dumps = "\n".join(p.read_text() for p in tmp_path.glob("*.mlir"))
    me = re.escape(os.path.abspath(__file__).replace("\\", "\\5C"))
    # In a fused graph, a call site from the op's index in the graph.
    add = re.search(rf'#op(\d+) = loc\((callsite\()?"aten::add\.Tensor"\("{me}":{add_line}:0\)', dumps)
    sort = re.search(rf'#op(\d+) = loc\((callsite\()?"aten::sort(\.\w+)?"\("{me}":{sort_line}:0\)', dumps)
    assert add and sort, dumps
    # The ops refer to those locations, inside the sort's comparator region too.
    assert re.search(rf'"stablehlo\.add"\(.*loc\(#op{add.group(1)}\)', dumps)
    assert re.search(rf'"stablehlo\.return"\(.*loc\(#op{sort.group(1)}\)', dumps)


@pytest.mark.parametrize("mode", ["fused", "lazy"])
@pytest.mark.parametrize("located", [True, False])
def test_compile_error_names_the_op_and_line(mode, located):
    cpu = torch.randn(10)
    torch_pjrt._C._inject_compile_fault("aten::tanh", located=located)
    try:
        with torch_pjrt.mode(mode):
            x = cpu.to("tpu")
            # Several ops on the failing op's line: the error still tells them apart.
            z = torch.tanh(x * 2 + 1).exp(); tanh_line = inspect.currentframe().f_lineno  # noqa: E702
            torch_pjrt.reset_metrics()
            with pytest.raises(RuntimeError) as info:
                z.sum().item()
    finally:
        torch_pjrt._C._inject_compile_fault("")
    message = str(info.value)
    assert re.search(r"failed at op \d+, aten::tanh\(Float\[10\]\)", message)
    assert f"{__file__}:{tanh_line} in test_compile_error_names" in message
    # A verifier error names the line (no prefix search); XLA's later error
    # about an unknown kernel does not, and the search finds the op.
    assert torch_pjrt.metrics()["failing_op_searches"] == (0 if located else 1)
    with torch_pjrt.mode(mode):
        torch.testing.assert_close(torch.tanh(cpu.to("tpu") * 2 + 1).exp().cpu(), torch.tanh(cpu * 2 + 1).exp())
