"""What a failed step leaves: the host state it changed is put back (csrc/aten/host_restores.h).

A device error (a bad index found by a check on the device, a fused graph that fails to compile or runs
out of memory) surfaces at the next host wait, after Python already ran more of the step. Every tpu
tensor the step wrote keeps its old value (docs/design/runtime-checks.md); this module does the same for
the host state a training loop changes: an optimizer's CPU step counts (capturable=False), LR schedulers
and GradScalers. Each saves its state before a change while the step may still fail and registers a
restore; the restores of a failed program run, newest first, before its error reaches the user, so a loop
that catches the error and skips the batch goes on as a CPU run that skipped it.

Parameters made on the device (`with torch.device("tpu")`) are still pending in fused mode when the
optimizer is built: their initial values run then, as a graph of their own, so a first step that fails
cannot take them with it.
"""
from __future__ import annotations

import copy
import functools
import itertools
import threading

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import _C

_lock = threading.RLock()
_restores: dict[int, object] = {}  # token -> restore function, while C++ holds the token
_tokens = itertools.count(1)


def _run_restores(tokens) -> None:
    # Called by C++ with the GIL, newest first, before the error is raised.
    for token in tokens:
        with _lock:
            restore = _restores.pop(token, None)
        if restore is not None:
            restore()


_C._set_host_restore_runner(_run_restores)


def _active() -> bool:
    return not (torch.compiler.is_compiling() or _C._is_in_bad_fork())


def may_fail(devices) -> list:
    """The devices among `devices` where the step so far may still fail (ops pending or a check unread)."""
    return [d for d in devices if _C._step_may_fail(d)]


def restore_if_failed(devices, restore) -> None:
    """restore() runs if a program that ran or will run what was recorded so far on one of `devices` fails."""
    if not devices:
        return
    with _lock:
        token = next(_tokens)
        for device in devices:
            _C._restore_host_state_if_failed(device, token)
        live = set(_C._registered_restores())
        for stale in [t for t in _restores if t not in live]:  # their programs passed
            del _restores[stale]
        _restores[token] = restore


def tpu_devices(optimizer) -> set:
    return {p.device.index or 0 for group in optimizer.param_groups for p in group["params"]
            if p.device.type == "tpu"}


# ---- optimizers: CPU step counts ----

def _host_state(optimizer) -> dict:
    """Per tpu device: the CPU tensors in its parameters' state (a capturable=False step count), and the
    parameters with no state yet (their first step makes it)."""
    found = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type != "tpu":
                continue
            counts, fresh = found.setdefault(p.device.index or 0, ([], []))
            state = optimizer.state.get(p)
            if not state:
                fresh.append(p)
                continue
            counts.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.device.type == "cpu")
    return found


def save_step_counts(optimizer) -> None:
    """Before optimizer.step(): what it will change on the host, where the step may fail."""
    optimizer.__dict__.pop("_tpu_host_state", None)
    if not _active():
        return
    saved = {d: (counts, [t.clone() for t in counts], fresh) for d, (counts, fresh) in _host_state(optimizer).items()
             if (counts or fresh) and may_fail([d])}
    if saved:
        optimizer.__dict__["_tpu_host_state"] = saved


def restore_step_counts_if_failed(optimizer) -> None:
    """After optimizer.step(), before its graph runs: the saved counts come back if it fails, and a state
    the failed step made (its first) is dropped, as on a CPU run whose first step never happened."""
    for device, (counts, saved, fresh) in optimizer.__dict__.pop("_tpu_host_state", {}).items():
        def restore(counts=counts, saved=saved, fresh=fresh):
            for t, v in zip(counts, saved):
                t.copy_(v)
            for p in fresh:
                optimizer.state.pop(p, None)
        restore_if_failed([device], restore)


# ---- LR schedulers ----

def _save_scheduler(scheduler) -> None:
    devices = may_fail(tpu_devices(scheduler.optimizer))
    if not devices:
        return
    # Shallow copies per attribute: counts and lists of floats. Nested schedulers (SequentialLR) save
    # themselves when stepped; the optimizer is not the scheduler's state.
    state = {k: copy.copy(v) for k, v in scheduler.__dict__.items() if k != "optimizer"}
    groups = scheduler.optimizer.param_groups
    lrs = [g.get("lr") for g in groups]
    saved_lrs = [lr.clone() if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" else lr for lr in lrs]

    def restore():
        scheduler.__dict__.update(state)
        for g, lr, old in zip(groups, saved_lrs, lrs):
            if not isinstance(lr, torch.Tensor):
                g["lr"] = lr
            elif lr is not old:  # a CPU tensor lr, changed in place ...
                g["lr"].copy_(lr)
            # ... a tpu one: the failed step's writes to it were dropped on the device
    restore_if_failed(devices, restore)


def _saving_scheduler(step):
    @functools.wraps(step)
    def scheduler_step(self, *args, **kwargs):
        if _active() and getattr(self, "optimizer", None) is not None:
            _save_scheduler(self)
        return step(self, *args, **kwargs)
    scheduler_step.__torch_pjrt_saves__ = True
    return scheduler_step


def _wrap_scheduler_class(cls) -> None:
    step = cls.__dict__.get("step")
    if step is not None and not getattr(step, "__torch_pjrt_saves__", False):
        cls.step = _saving_scheduler(step)


def _patch_schedulers() -> None:
    from torch.optim import lr_scheduler
    base = lr_scheduler.LRScheduler
    seen, todo = set(), [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            _wrap_scheduler_class(cls)
            todo.extend(cls.__subclasses__())
    previous = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):  # a user's scheduler with its own step()
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        _wrap_scheduler_class(cls)
    base.__init_subclass__ = classmethod(__init_subclass__)


# ---- GradScaler ----

def _save_scaler(scaler, optimizer=None) -> None:
    if getattr(scaler, "_device", None) != "tpu" or not scaler.is_enabled():
        return
    devices = tpu_devices(optimizer) if optimizer is not None else set()
    if getattr(scaler, "_scale", None) is not None:
        devices.add(scaler._scale.device.index or 0)
    devices = may_fail(devices)
    if not devices:
        return
    states = copy.copy(scaler._per_optimizer_states)  # a defaultdict: keeps its factory
    for key, state in states.items():
        states[key] = dict(state, found_inf_per_device=dict(state["found_inf_per_device"]))
    restore_if_failed(devices, lambda: setattr(scaler, "_per_optimizer_states", states))


def _saving_scaler(method, takes_optimizer):
    @functools.wraps(method)
    def scaler_method(self, *args, **kwargs):
        if _active():
            optimizer = (args[0] if args else kwargs.get("optimizer")) if takes_optimizer else None
            _save_scaler(self, optimizer)
        return method(self, *args, **kwargs)
    return scaler_method


def _patch_grad_scaler() -> None:
    from torch.amp.grad_scaler import GradScaler
    # unscale_ first changes a stage (UNSCALED), step() then reads the found-inf flags: the read that
    # raises a failure of the forward or backward, with the stage already changed.
    GradScaler.unscale_ = _saving_scaler(GradScaler.unscale_, True)
    GradScaler.step = _saving_scaler(GradScaler.step, True)
    update = _saving_scaler(GradScaler.update, False)

    @functools.wraps(update)
    def update_and_cut(self, *args, **kwargs):
        update(self, *args, **kwargs)
        # The step ends here, not at optimizer.step(): its scale update runs in the step's last graph, so a
        # failure in the next batch's graph neither drops this update nor puts back this step's host state.
        if self._device == "tpu" and _active() and _C._get_mode() == "fused" and not _C._capturing():
            _C._sync()
    GradScaler.update = update_and_cut


# ---- parameters made on the device ----

def _run_pending_initialization(optimizer) -> None:
    # The optimizer is built after the model and before its first step: what the model's initialization
    # recorded runs now, so parameters have values of their own that a failed first step keeps. It is
    # waited for: a first step launched on inputs still being computed has them consumed (donated) even
    # when it then fails to allocate its memory.
    if not _active() or _C._get_mode() not in ("fused", "lazy") or _C._capturing():
        return
    for device in tpu_devices(optimizer):
        torch.tpu.synchronize(device)


def _patch_add_param_group() -> None:
    add = torch.optim.Optimizer.add_param_group

    @functools.wraps(add)
    def add_param_group(self, param_group):
        add(self, param_group)
        _run_pending_initialization(self)
    torch.optim.Optimizer.add_param_group = add_param_group


def install() -> None:
    register_optimizer_step_pre_hook(lambda opt, args, kwargs: save_step_counts(opt))
    _patch_schedulers()
    _patch_grad_scaler()
    _patch_add_param_group()
