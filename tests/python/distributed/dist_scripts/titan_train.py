"""Runs `python -m torchtitan.train ARGS` as a user would, with torch_pjrt imported first (what `import torch` does
when torch_pjrt is installed; the tests run it from the source tree), and prints each logged step's loss in full
precision on rank 0 (torchtitan's own log line rounds to 5 decimals):

    TITAN_LOSS step=3 loss=7.123456789 grad_norm=1.23

Used by tests/python/distributed/test_torchtitan.py under torchrun, in a directory made by titan_assets.py.
"""
import os
import runpy
import sys

import torch_pjrt  # noqa: F401  (registers tpu; must come before torchtitan picks its device at import)

from torchtitan.components import metrics


def _print_losses(log):
    def wrapper(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"TITAN_LOSS step={step} loss={float(global_avg_loss)!r} grad_norm={float(grad_norm)!r}",
                  flush=True)
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    return wrapper


metrics.MetricsProcessor.log = _print_losses(metrics.MetricsProcessor.log)
sys.argv = ["torchtitan.train", *sys.argv[1:]]
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
