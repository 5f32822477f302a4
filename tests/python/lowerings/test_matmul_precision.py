"""torch.set_float32_matmul_precision decides how float32 dots and convolutions
compute, as it does for CUDA: "highest" (PyTorch's default) is full float32
(XLA's HIGHEST, no TF32 on a GPU); "high" and "medium" allow the faster passes.
The precision is part of each op's key, so changing it never reuses a program
built for the other."""
import os
import subprocess
import sys
import textwrap

import torch

SCRIPT = textwrap.dedent("""
    import glob, os, torch, torch_pjrt
    import torch.nn.functional as F
    torch.manual_seed(0)
    dump = os.environ["TORCH_PJRT_DUMP_DIR"]

    def precisions(fn):
        before = set(glob.glob(dump + "/*"))
        fn()
        texts = [open(p).read() for p in set(glob.glob(dump + "/*")) - before]
        return sorted({t.split("precision ")[1].split(">")[0] for t in texts if "precision " in t})

    for size, mode in enumerate(("strict", "fused")):
        # new shapes per mode: a one-op fused graph may reuse strict's program
        a, b = torch.randn(16, 8 + size), torch.randn(8 + size, 4)
        image, weight = torch.randn(1, 3, 8 + size, 8), torch.randn(2, 3, 3, 3)
        with torch_pjrt.mode(mode):
            for setting, expected in (("highest", ["HIGHEST"]), ("high", ["HIGH"]), ("medium", ["DEFAULT"])):
                torch.set_float32_matmul_precision(setting)
                out = {}
                def run():
                    out["mm"] = (a.to("tpu") @ b.to("tpu")).cpu()
                    out["conv"] = F.conv2d(image.to("tpu"), weight.to("tpu")).cpu()
                got = precisions(run)
                assert got == expected, (mode, setting, got)
                # "highest" is float32's own tolerance; the others allow TF32 / bf16 passes on a GPU
                tol = {} if setting == "highest" else dict(rtol=2e-2, atol=2e-2)
                torch.testing.assert_close(out["mm"], a @ b, **tol)
                torch.testing.assert_close(out["conv"], F.conv2d(image, weight), **tol)
            torch.set_float32_matmul_precision("highest")
            # float64 and bfloat16 dots carry no float32 precision
            assert precisions(lambda: (a.double().to("tpu") @ b.double().to("tpu")).cpu()) == []
    print("ok")
""")


def test_float32_matmul_precision_reaches_programs(tmp_path):
    env = dict(os.environ, TORCH_PJRT_DUMP_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_default_precision_is_highest():
    assert torch.get_float32_matmul_precision() == "highest"
