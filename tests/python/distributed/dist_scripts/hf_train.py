"""accelerate and the HF Trainer on tpu, run unchanged under torchrun / `accelerate launch` (or alone).

--api accelerate: Accelerator.prepare + a loop (SGD, momentum) on a global batch of 8 split over the processes,
  checked in every process against one CPU process training on the whole batch (losses and parameters).
--api trainer: Trainer (SGD, constant lr, no clipping) on a global batch of 8; rank 0 writes the logged losses and
  the final parameters to --out, which the test compares between a 2-process and a 1-process run.

Both check that accelerate set the process up distributed when WORLD_SIZE > 1 (tpu_dist, DDP, the world size).
--accelerate-first imports accelerate before torch, as a script beginning `from accelerate import Accelerator`.
Run by tests/python/distributed/test_accelerate_launch.py. Prints "RESULT rank=R ..." and exits 1 on a failure.
"""
import argparse
import json
import os
import sys

if "--accelerate-first" in sys.argv:
    # A script that starts with accelerate: an installed torch_pjrt then loads in the middle of accelerate's own
    # import (accelerate.accelerator imports torch, which loads it), before accelerate's classes exist.
    from accelerate import Accelerator  # noqa: F401
    AUTOLOADED = "torch_pjrt" in sys.modules

import torch

import torch_pjrt  # an installed torch_pjrt is loaded by `import torch`; here PYTHONPATH stands in for that

parser = argparse.ArgumentParser()
parser.add_argument("--api", choices=["accelerate", "trainer"], required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", default="")
parser.add_argument("--compile", action="store_true",
                    help="trainer: Trainer(torch_compile_backend='tpu'); accelerate: check that the launcher's "
                         "`--dynamo_backend tpu` compiled the model")
parser.add_argument("--accelerate-first", action="store_true",
                    help="import accelerate before torch (check that torch_pjrt was autoloaded by it)")
args = parser.parse_args()

GLOBAL_BATCH = 8
world = int(os.environ.get("WORLD_SIZE", "1"))


def say(line):
    """One write per line: the ranks share the launcher's stdout pipe."""
    os.write(1, (line + "\n").encode())


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(GLOBAL_BATCH * args.steps, 8, generator=g), torch.randn(GLOBAL_BATCH * args.steps, 4, generator=g)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x, labels=None):
        out = self.body(x)
        if labels is None:
            return {"logits": out}
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def check_distributed(state, model, failures):
    if state.num_processes != world:
        failures.append(f"accelerate sees {state.num_processes} processes, WORLD_SIZE={world}")
    if state.device.type != "tpu":
        failures.append(f"accelerate's device is {state.device}")
    if world > 1:
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() != world:
            failures.append("torch.distributed is not initialized with the world size")
        elif "tpu_dist" not in str(dist.get_backend_config()):
            failures.append(f"process group backend {dist.get_backend_config()}")
        model = getattr(model, "_orig_mod", model)  # compiled around DDP
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            failures.append(f"model is a {type(model).__name__}, not DDP")


def run_accelerate(failures):
    from accelerate import Accelerator

    x_all, y_all = data()
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for step in range(args.steps):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = ref(x_all[sl], y_all[sl])["loss"]
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    accelerator = Accelerator()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_all, y_all),
                                         batch_size=GLOBAL_BATCH // accelerator.num_processes)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    check_distributed(accelerator.state, model, failures)
    if args.compile:
        backend = accelerator.state.dynamo_plugin.backend
        if backend.value != "TPU" or not hasattr(model, "_orig_mod"):
            failures.append(f"dynamo backend {backend}, model a {type(model).__name__}: not compiled with tpu")
    losses = []
    for x, y in loader:
        loss = model(x, y)["loss"]
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    accelerator.wait_for_everyone()
    if len(losses) != args.steps:
        failures.append(f"{len(losses)} steps, expected {args.steps}")
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if abs(got - want) > 1e-5 * max(1.0, abs(want)):
            failures.append(f"loss at step {step}: {got} vs one process {want}")
    for (name, p), q in zip(accelerator.unwrap_model(model).named_parameters(), ref.parameters()):
        if not torch.allclose(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6):
            failures.append(f"parameter {name}: max diff {(p.detach().cpu() - q.detach()).abs().max().item()}")
    return accelerator, losses


def run_trainer(failures):
    import tempfile

    from transformers import Trainer, TrainingArguments

    x_all, y_all = data()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(x_all)

        def __getitem__(self, i):
            return {"x": x_all[i], "labels": y_all[i]}

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=GLOBAL_BATCH // world,
                              max_steps=args.steps, logging_steps=1, report_to="none", save_strategy="no",
                              max_grad_norm=0.0, seed=0, data_seed=0, disable_tqdm=True,
                              dataloader_num_workers=0,
                              torch_compile_backend="tpu" if args.compile else None)
    trainer = Trainer(model=model, args=targs, train_dataset=Rows(), optimizers=(opt, sched))
    trainer.train()
    check_distributed(trainer.accelerator.state, trainer.model_wrapped, failures)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if args.compile and not hasattr(trainer.model_wrapped, "_orig_mod"):
        failures.append(f"torch_compile_backend='tpu' did not compile the model ({type(trainer.model_wrapped)})")
    if len(losses) != args.steps:
        failures.append(f"{len(losses)} logged losses, expected {args.steps}")
    if args.out and trainer.accelerator.is_main_process:
        params = {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()}
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "params": params}, f)
    return trainer.accelerator, losses


failures = []
if args.accelerate_first and not AUTOLOADED:
    failures.append("`from accelerate import Accelerator` did not load torch_pjrt (is it installed?)")
accelerator, losses = (run_accelerate if args.api == "accelerate" else run_trainer)(failures)
rank = accelerator.process_index
for f in failures:
    say(f"rank {rank} FAIL {f}")
say(f"RESULT rank={rank} failures={len(failures)} type={accelerator.distributed_type.value} "
    f"processes={accelerator.num_processes} device={accelerator.device} losses={[round(v, 6) for v in losses]}")
accelerator.end_training()
sys.exit(1 if failures else 0)
