"""Collectives across this process's tpu devices, run as ONE XLA program.

Each participant is a device of this process (the CPU plugin's virtual devices:
``TORCH_PJRT_CPU_DEVICES=N``). A collective is compiled once per (collective,
shape, dtype, device list) for N replicas and executed with one argument list
per device (``PJRT_LoadedExecutable_Execute`` with ``num_devices = N``); the
plugin's own in-process collectives move the data. Every run counts in
``torch_pjrt.metrics()["collectives_in_xla"]`` and its input bytes (summed over
the devices) in ``["collective_bytes"]``.

API for callers (the ``tpu_dist`` c10d backend, thread ranks, tests)
--------------------------------------------------------------------
List form: ``tensors[i]`` is replica i's input, each on its own tpu device, all
of one dtype and shape (any strides). Each returns a list of NEW tensors,
``result[i]`` on ``tensors[i].device``; nothing is written in place (use the
``*_`` forms or ``copy_``). ``op`` is "sum", "avg", "max", "min", "prod" or a
``torch.distributed.ReduceOp``; ``groups`` is a list of lists of replica
indices (positions in ``tensors``) that partition them, each group running
the collective among itself (default: one group of all). Bad inputs raise
ValueError/TypeError naming the problem.

- ``all_reduce(tensors, op="sum", groups=None)``; ``all_reduce_(...)`` writes
  the results back into ``tensors``. avg needs floating point or complex
  tensors; f16/bf16 accumulate in f32 (one rounding); max/min propagate NaN.
- ``all_gather(tensors, dim=0, groups=None)``: the group's inputs concatenated
  along ``dim`` in group order (``all_gather_into_tensor``).
- ``reduce_scatter(tensors, op="sum", dim=0, groups=None)``: reduce, then
  replica k of its group keeps chunk k of ``dim`` (``reduce_scatter_tensor``).
- ``all_to_all(tensors, dim=0, groups=None)``: chunk j of ``dim`` goes to the
  group's j-th replica, received chunks concatenated in sender order
  (``all_to_all_single`` with equal splits).
- ``collective_permute(tensors, pairs)``: ``(source, target)`` replica pairs,
  each source and target at most once; a replica that is no target gets zeros
  (send/recv).
- ``broadcast(tensors, src=0, groups=None)``: every replica gets the group's
  ``src``-th replica's value (bit-exact).

Thread ranks: ``run_in_threads(fn, world_size, timeout=600.0)`` runs
``fn(rank)`` in ``world_size`` threads, thread ``rank`` with ``tpu:rank`` as
its current device, and returns their results in rank order. Inside ``fn`` the
rank functions ``rank_all_reduce(t, op)``, ``rank_all_gather(t, dim)``,
``rank_reduce_scatter(t, op, dim)``, ``rank_all_to_all(t, dim)``,
``rank_broadcast(t, src)``, ``rank_permute(t, pairs)`` (torch.distributed
style: the reductions and broadcast also write into ``t``; all return the
result) rendezvous in-process: the last rank to arrive issues one
multi-device program for all of them. ``ThreadGroup(world_size, timeout)``
with ``group.collective(rank, kind, tensor, **kwargs)`` is the same
rendezvous without threads started for you (a c10d backend holds one per
process group). Ranks must call collectives in the same order with the same
kind and arguments; a mismatch raises in every rank, and a rank that does not
arrive within ``timeout`` seconds (default 600, NCCL's default; or raised)
makes the others raise an error naming the collective and the missing ranks
instead of hanging.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from . import _C

__all__ = [
    "all_reduce", "all_reduce_", "all_gather", "reduce_scatter", "all_to_all", "collective_permute", "broadcast",
    "ThreadGroup", "run_in_threads", "rank_all_reduce", "rank_all_gather", "rank_reduce_scatter",
    "rank_all_to_all", "rank_broadcast", "rank_permute", "thread_rank", "thread_world_size",
]

_OPS = ("sum", "avg", "max", "min", "prod")


def _op_name(op: Any) -> str:
    if isinstance(op, str):
        name = op.lower()
    else:  # torch.distributed.ReduceOp (its .op is a RedOpType) or a RedOpType
        op_type = getattr(op, "op", op)
        name = str(getattr(op_type, "name", None) or op_type).split(".")[-1].lower()
    if name == "product":
        name = "prod"
    if name not in _OPS:
        raise ValueError(f"unsupported reduce op {op!r}: expected one of {', '.join(_OPS)}")
    return name


def _inputs(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: tensors[{i}] is {type(t).__name__}, not a Tensor")
    return tensors


def _groups(groups: Sequence[Sequence[int]] | None) -> list[list[int]]:
    return [] if groups is None else [[int(r) for r in g] for g in groups]


def _dim(tensors: list[torch.Tensor], dim: int, what: str) -> int:
    rank = tensors[0].dim() if tensors else 0
    if rank == 0:
        raise ValueError(f"{what}: needs tensors with at least one dim, got a 0-d tensor")
    if not -rank <= dim < rank:
        raise IndexError(f"{what}: dim {dim} is out of range for a {rank}-d tensor")
    return dim % rank


def all_reduce(tensors, op="sum", groups=None) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "all_reduce")
    return _C._xla_collective("all_reduce", tensors, op=_op_name(op), groups=_groups(groups))


def all_reduce_(tensors, op="sum", groups=None) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "all_reduce_")
    for t, r in zip(tensors, all_reduce(tensors, op, groups)):
        t.copy_(r)
    return tensors


def all_gather(tensors, dim=0, groups=None) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "all_gather")
    return _C._xla_collective("all_gather", tensors, dim=_dim(tensors, dim, "all_gather"), groups=_groups(groups))


def reduce_scatter(tensors, op="sum", dim=0, groups=None) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "reduce_scatter")
    return _C._xla_collective("reduce_scatter", tensors, op=_op_name(op), dim=_dim(tensors, dim, "reduce_scatter"),
                              groups=_groups(groups))


def all_to_all(tensors, dim=0, groups=None) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "all_to_all")
    return _C._xla_collective("all_to_all", tensors, dim=_dim(tensors, dim, "all_to_all"), groups=_groups(groups))


def collective_permute(tensors, pairs) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "collective_permute")
    return _C._xla_collective("collective_permute", tensors, pairs=[(int(s), int(t)) for s, t in pairs])


def broadcast(tensors, src=0, groups=None) -> list[torch.Tensor]:
    tensors = _inputs(tensors, "broadcast")
    return _C._xla_collective("broadcast", tensors, root=int(src), groups=_groups(groups))


_LIST_FORMS: dict[str, Callable[..., list[torch.Tensor]]] = {
    "all_reduce": all_reduce, "all_gather": all_gather, "reduce_scatter": reduce_scatter,
    "all_to_all": all_to_all, "broadcast": broadcast, "collective_permute": collective_permute,
}


# ---------------------------------------------------------------------------
# Thread ranks: one thread per device, collectives meet in-process.


class CollectiveError(RuntimeError):
    """A collective of a ThreadGroup could not complete (timeout, mismatch, a failed rank)."""


class ThreadGroup:
    """A rendezvous for ``world_size`` ranks of this process, rank r on its own device.

    ``collective(rank, kind, tensor, **kwargs)`` blocks until every rank has
    called it (the n-th call of each rank meets the n-th of the others), then
    returns this rank's result of the list form ``kind`` (see the module doc)
    run once, as one program, over all ranks' tensors.
    """

    def __init__(self, world_size: int, timeout: float = 600.0):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._calls = [0] * world_size  # collectives each rank has entered
        self._slots: dict[int, dict] = {}  # call index -> {"args": {rank: (kind, tensor, kwargs)}, "results"/"error"}
        self._broken: str | None = None

    def abort(self, reason: str) -> None:
        """Makes every waiting and later collective raise ``reason`` (a rank failed)."""
        with self._cond:
            if self._broken is None:
                self._broken = reason
            self._cond.notify_all()

    def collective(self, rank: int, kind: str, tensor: torch.Tensor, **kwargs) -> torch.Tensor:
        if kind not in _LIST_FORMS:
            raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(_LIST_FORMS)}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        with self._cond:
            self._check_broken(kind, rank)
            index = self._calls[rank]
            self._calls[rank] += 1
            slot = self._slots.setdefault(index, {"args": {}})
            slot["args"][rank] = (kind, tensor, kwargs)
            if len(slot["args"]) == self.world_size:
                self._run(slot)  # the last rank to arrive issues the program for all
                self._cond.notify_all()
            else:
                self._wait(slot, index, kind, rank)
            if "error" in slot:
                raise CollectiveError(slot["error"])
            result = slot["results"][rank]
            slot["taken"] = slot.get("taken", 0) + 1
            if slot["taken"] == self.world_size:
                del self._slots[index]
            return result

    def _check_broken(self, kind: str, rank: int) -> None:
        if self._broken is not None:
            raise CollectiveError(f"{kind} on rank {rank}: the group is broken: {self._broken}")

    def _wait(self, slot: dict, index: int, kind: str, rank: int) -> None:
        done = self._cond.wait_for(lambda: "results" in slot or "error" in slot or self._broken is not None,
                                   timeout=self.timeout)
        if "results" in slot or "error" in slot:
            return
        missing = sorted(set(range(self.world_size)) - set(slot["args"]))
        reason = self._broken if done else f"timed out after {self.timeout} s waiting for rank(s) {missing}"
        slot["error"] = f"{kind} (collective #{index}) on rank {rank}: {reason}"
        if self._broken is None:
            self._broken = slot["error"]
        self._cond.notify_all()

    def _run(self, slot: dict) -> None:
        args = slot["args"]
        kind, _, kwargs = args[0]
        for r in range(1, self.world_size):
            k, _, kw = args[r]
            if k != kind or kw != kwargs:
                slot["error"] = (f"ranks disagree on collective: rank 0 called {kind}({kwargs}), "
                                 f"rank {r} called {k}({kw})")
                return
        tensors = [args[r][1] for r in range(self.world_size)]
        try:
            slot["results"] = _LIST_FORMS[kind](tensors, **kwargs)
        except Exception as e:  # every rank sees the same error
            slot["error"] = f"{kind}: {type(e).__name__}: {e}"


_local = threading.local()


def _current() -> tuple[ThreadGroup, int]:
    group = getattr(_local, "group", None)
    if group is None:
        raise RuntimeError("rank collectives run only inside torch_pjrt._xla_collectives.run_in_threads")
    return group, _local.rank


def thread_rank() -> int:
    return _current()[1]


def thread_world_size() -> int:
    return _current()[0].world_size


def run_in_threads(fn: Callable[[int], Any], world_size: int, timeout: float = 600.0) -> list[Any]:
    """Runs ``fn(rank)`` on ``world_size`` threads, rank r on ``tpu:r``; returns the results by rank.

    An exception in any rank breaks the group (the others' collectives raise
    instead of waiting) and is re-raised here, naming its rank.
    """
    if world_size > torch.tpu.device_count():
        raise ValueError(f"run_in_threads: {world_size} ranks need {world_size} tpu devices, "
                         f"this process has {torch.tpu.device_count()} (TORCH_PJRT_CPU_DEVICES)")
    group = ThreadGroup(world_size, timeout)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        _local.group, _local.rank = group, rank
        torch.tpu.set_device(rank)
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            group.abort(f"rank {rank} raised {type(e).__name__}: {e}")
        finally:
            _local.group = None

    threads = [threading.Thread(target=body, args=(r,), name=f"tpu-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The first failure is the cause; others are usually its consequence (CollectiveError).
    failed = [r for r in range(world_size) if errors[r] is not None]
    if failed:
        first = next((r for r in failed if not isinstance(errors[r], CollectiveError)), failed[0])
        raise RuntimeError(f"rank {first} of {world_size} failed: {errors[first]}") from errors[first]
    return results


def rank_all_reduce(tensor: torch.Tensor, op="sum") -> torch.Tensor:
    group, rank = _current()
    result = group.collective(rank, "all_reduce", tensor, op=_op_name(op))
    tensor.copy_(result)
    return tensor


def rank_all_gather(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    group, rank = _current()
    return group.collective(rank, "all_gather", tensor, dim=dim)


def rank_reduce_scatter(tensor: torch.Tensor, op="sum", dim: int = 0) -> torch.Tensor:
    group, rank = _current()
    return group.collective(rank, "reduce_scatter", tensor, op=_op_name(op), dim=dim)


def rank_all_to_all(tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    group, rank = _current()
    return group.collective(rank, "all_to_all", tensor, dim=dim)


def rank_broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    group, rank = _current()
    tensor.copy_(group.collective(rank, "broadcast", tensor, src=src))
    return tensor


def rank_permute(tensor: torch.Tensor, pairs) -> torch.Tensor:
    group, rank = _current()
    return group.collective(rank, "collective_permute", tensor, pairs=[(int(s), int(t)) for s, t in pairs])
