"""The `tpu_dist` c10d backend: torch.distributed for `tpu` tensors.

    dist.init_process_group()               # tpu tensors -> tpu_dist, cpu tensors -> gloo
    dist.init_process_group("tpu_dist")     # tpu_dist for both (cpu tensors go straight to its Gloo)

The C++ side (csrc/bindings/dist_backend.cpp) is a c10d::Backend whose every
collective calls the method of the same name on a `_TpuDistBackend` here.
Each method picks the path for its tensors. Today there is one path across
processes on the CPU plugin: *staged through Gloo* (copy tpu tensors to host,
run Gloo's collective on a Gloo group made from the same store and ranks, copy
the results back into the user's tensors in place, views included). An
in-XLA path (several devices in one process; a PJRT distributed client) plugs
in per collective in `_TpuDistBackend._path`.

Staged collectives run to completion before they return (the returned Work is
already done, async_op=True included), except send/recv, which return at once
and finish in wait(): a rank may post irecv before its isend.

torchrun: with the CPU plugin each process has its own client and sees its
device as tpu:0. With TORCH_PJRT_CPU_DEVICES=N (N > 1) in every process,
LOCAL_RANK % N becomes the current device at import (torch.tpu.current_device()).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend, _create_work_from_future
from torch.distributed import distributed_c10d as c10d

from . import _C

BACKEND_NAME = "tpu_dist"
GLOO_STORE_PREFIX = "tpu_dist_gloo/"
PROGRESS_STORE_PREFIX = "tpu_dist_progress/"


def _keep_until_exit(group) -> None:
    """Never destroys `group` (a Gloo group whose collective failed): ProcessGroupGloo's destructor joins its
    worker threads, and after a timeout their peer may never answer, so tearing it down at exit could hang the
    process that has just reported the failure. A reference no one holds outlives the module's teardown."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


# Python-side counters, merged into torch_pjrt.metrics().
_counters = {
    "dist_collectives_staged": 0,  # collectives run through Gloo via host memory
    "dist_collectives_local": 0,  # collectives of a one-rank group: device copies in the pending graph
    "dist_collectives_in_xla": 0,  # collectives lowered into XLA programs (in-process path, not here yet)
    "dist_staged_bytes_to_host": 0,
    "dist_staged_bytes_to_device": 0,
}
_counters_lock = threading.Lock()


def counters() -> dict:
    with _counters_lock:
        return dict(_counters)


def reset_counters() -> None:
    with _counters_lock:
        for key in _counters:
            _counters[key] = 0


def _count(key: str, n: int = 1) -> None:
    with _counters_lock:
        _counters[key] += n


def _is_tpu(t: torch.Tensor) -> bool:
    return t.device.type == "tpu"


def _copy(out: torch.Tensor, src: torch.Tensor) -> None:
    """out = src's elements in order (a one-rank gather or scatter: the shapes may differ, the counts do not)."""
    if out.dtype != src.dtype:
        raise TypeError(f"tpu_dist: output dtype {out.dtype} differs from input dtype {src.dtype}")
    if out.numel() != src.numel():
        raise ValueError(f"tpu_dist: output has {out.numel()} elements, input {src.numel()}; a one-rank group "
                         "needs the same count")
    with torch.no_grad():
        out.copy_(src.reshape(out.shape))


def _only(tensors):
    """The one tensor per rank of a list in a one-rank group."""
    if len(tensors) != 1:
        raise ValueError(f"tpu_dist: a one-rank group needs 1 tensor per list, got {len(tensors)}")
    return tensors[0]


def _copy_each(outs, srcs) -> None:
    for out, src in zip(outs, srcs, strict=True):
        _copy(out, src)


def _done_work(result) -> dist.Work:
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _Staging:
    """Host copies of one collective's tpu tensors, and the copies back."""

    def __init__(self):
        self.back = []  # (user tensor, host tensor) written after the collective

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor with t's values (t itself on the CPU)."""
        if not _is_tpu(t):
            return t
        host = t.detach().to("cpu").contiguous()
        _count("dist_staged_bytes_to_host", host.numel() * host.element_size())
        return host

    def write(self, t: torch.Tensor, read: bool = False) -> torch.Tensor:
        """A host tensor the collective writes; copied into t afterwards (with t's values if read)."""
        if not _is_tpu(t):
            return t
        host = self.read(t) if read else torch.empty(t.shape, dtype=t.dtype)
        self.back.append((t, host))
        return host

    def finish(self) -> None:
        for t, host in self.back:
            with torch.no_grad():
                t.copy_(host)
            _count("dist_staged_bytes_to_device", host.numel() * host.element_size())
        self.back = []


class _PendingWork(dist.Work):
    """A staged send/recv: Gloo's work runs on; wait() waits and copies a receive back."""

    def __init__(self, backend, name, inner, staging, result):
        super().__init__()
        self._backend, self._name, self._inner, self._staging = backend, name, inner, staging
        self._result = result
        self._lock = threading.Lock()
        self._fut = torch.futures.Future()
        self._done = False

    def wait(self, timeout=None):
        with self._lock:
            if not self._done:
                self._backend._wait(self._name, self._inner)
                self._staging.finish()
                self._done = True
                self._fut.set_result(self._result)
        return True

    def is_completed(self):
        return self._done

    def get_future(self):
        # Completed by wait(): a receive's copy into a tpu tensor runs on the waiting thread.
        return self._fut


class _TpuDistBackend:
    """Python half of the tpu_dist backend: one method per c10d collective."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, group_name: str = "",
                 global_ranks=None):
        self.rank, self.size, self.timeout = rank, size, timeout
        self.group_name = group_name or "default"
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self._store = store
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(GLOO_STORE_PREFIX, store), rank, size, timeout)
        self._seq = 0
        self._splits = 0
        self._failure = None  # the first failed collective's message: the group is unusable after it

    # -- paths -------------------------------------------------------------------------------------
    def _path(self, name: str, tensors) -> str:
        """Where this collective runs: "staged" (Gloo through host memory: across processes on the CPU plugin).

        The place for the other paths: "xla" (a collective op inside the device program: several devices in one
        process, or a plugin with a PJRT distributed client). They return their own name here and run in
        `_run` instead of the staged body."""
        return "staged"

    def _run(self, name: str, tensors, run, result, local):
        """One collective: `run(staging)` starts Gloo's collective on host tensors and returns its work;
        this waits, copies results back into the user's tensors and returns a finished Work.

        In a one-rank group every collective is the identity or a copy: `local()` records it as device ops,
        so it joins the pending fused graph (no host round trip, no cut), and no store key is written."""
        if self.size == 1:
            self._check_usable(name)
            local()
            if any(_is_tpu(t) for t in tensors):
                _count("dist_collectives_local")
            return _done_work(result)
        path = self._path(name, tensors)
        if path != "staged":
            raise NotImplementedError(f"tpu_dist: no {path} path for {name}")
        self._enter(name)
        staging = _Staging()
        work = run(staging)
        self._wait(name, work)
        staging.finish()
        if any(_is_tpu(t) for t in tensors):
            _count("dist_collectives_staged")
        return _done_work(result)

    # -- failures ----------------------------------------------------------------------------------
    def _enter(self, name: str) -> None:
        """Records how far this rank got, so a failure can say which ranks never arrived."""
        self._check_usable(name)
        self._seq += 1
        try:
            self._store.set(f"{PROGRESS_STORE_PREFIX}{self.rank}", f"{self._seq} {name}")
        except Exception:  # the store may be gone; the collective itself will say so
            pass

    def _check_usable(self, name: str) -> None:
        if self._failure is not None:
            # Gloo's pairs may hold half a message from the failed collective: like NCCL after an abort,
            # the group refuses further work instead of mismatching data or waiting out another timeout.
            raise RuntimeError(f"tpu_dist: {name} on process group '{self.group_name}' refused: an earlier "
                               f"collective of this group failed ({self._failure}). Create a new group or "
                               "restart the ranks.")

    def _wait(self, name: str, work) -> None:
        try:
            work.wait()
        except Exception as e:
            failure = self._failure_summary(name)
            if self._failure is None:
                self._failure = failure
                _keep_until_exit(self._gloo)
            raise RuntimeError(f"{failure}. Gloo said: {e}") from e

    def _failure_summary(self, name: str) -> str:
        me = self.global_ranks[self.rank]
        head = (f"tpu_dist: {name} (collective #{self._seq} of process group '{self.group_name}') failed on rank "
                f"{me} of {self.size} (timeout {self.timeout.total_seconds():g} s)")
        return f"{head}: {self._laggards()}"

    def _laggards(self) -> str:
        """Which ranks had not reached this collective, from the progress keys in the store."""
        behind = []
        try:
            for r in range(self.size):
                if r == self.rank:
                    continue
                key = f"{PROGRESS_STORE_PREFIX}{r}"
                if not self._store.check([key]):
                    behind.append(f"rank {self.global_ranks[r]} (no collective yet)")
                    continue
                seq, what = self._store.get(key).decode().split(" ", 1)
                if int(seq) < self._seq:
                    behind.append(f"rank {self.global_ranks[r]} (last reached #{seq} {what})")
        except Exception as e:
            return f"the rendezvous store is unreachable ({type(e).__name__}), so its host (rank 0) likely stopped"
        if not behind:
            return "every rank reached it, so a peer stopped or failed inside it"
        return "not reached by " + ", ".join(behind) + ": stopped, stalled or running other code"

    # -- reductions --------------------------------------------------------------------------------
    def _reduce_op(self, name, opts, tensors, make_opts):
        """Gloo's options for opts.reduceOp, the divisor for AVG (Gloo has no AVG: SUM, then divide) and the
        factor of PREMUL_SUM (NCCL's: each rank's input times the factor, then SUM; FSDP2 uses it for a gradient
        divide factor other than the group size), or None."""
        op = opts.reduceOp
        divisor = factor = None
        if op == dist.ReduceOp.AVG or op == dist.ReduceOp.PREMUL_SUM:  # not `in`: RedOpType == ReduceOp is False
            what = "AVG" if op == dist.ReduceOp.AVG else "PREMUL_SUM"
            bad = [t.dtype for t in tensors if not (t.is_floating_point() or t.is_complex())]
            if bad:
                raise TypeError(f"tpu_dist: {name} with ReduceOp.{what} needs floating tensors, got {bad[0]}")
            if op == dist.ReduceOp.AVG:
                divisor = self.size
            else:
                factor = op.factor  # a Python float, or a one-element tensor
                if isinstance(factor, torch.Tensor) and factor.numel() != 1:
                    raise ValueError(f"tpu_dist: {name} with ReduceOp.PREMUL_SUM needs a scalar factor, got a "
                                     f"tensor of shape {tuple(factor.shape)}")
            op = dist.ReduceOp.SUM
        gloo_opts = make_opts()
        gloo_opts.reduceOp = op
        gloo_opts.timeout = opts.timeout
        return gloo_opts, divisor, factor

    @staticmethod
    def _divide(hosts, divisor):
        if divisor is not None:
            for h in hosts:
                h.div_(divisor)

    @staticmethod
    def _premul(hosts, factor, in_place):
        """PREMUL_SUM's scaling of this rank's host inputs before the SUM: in place for buffers that are written
        back anyway (all_reduce, reduce), else new tensors (a reduce-scatter's input is the user's, unchanged)."""
        if factor is None:
            return hosts
        if isinstance(factor, torch.Tensor):
            factor = factor.detach().to("cpu")
        if in_place:
            for h in hosts:
                h.mul_(factor)
            return hosts
        return [h * factor for h in hosts]

    @staticmethod
    def _scale_local(tensors, factor):
        """A one-rank group's PREMUL_SUM: the sum of one input is the input times the factor (on the device)."""
        if factor is not None:
            for t in tensors:
                t.mul_(factor.to(t.device) if isinstance(factor, torch.Tensor) else factor)

    def allreduce(self, tensors, opts):
        gloo_opts, divisor, factor = self._reduce_op("all_reduce", opts, tensors, dist.AllreduceOptions)

        def run(s):
            hosts = self._premul([s.write(t, read=True) for t in tensors], factor, in_place=True)
            work = self._gloo.allreduce(hosts, gloo_opts)
            return _Then(work, lambda: self._divide(hosts, divisor))

        return self._run("all_reduce", tensors, run, tensors, local=lambda: self._scale_local(tensors, factor))

    def allreduce_coalesced(self, tensors, opts):
        gloo_opts, divisor, factor = self._reduce_op("all_reduce_coalesced", opts, tensors,
                                                     dist.AllreduceCoalescedOptions)

        def run(s):
            hosts = self._premul([s.write(t, read=True) for t in tensors], factor, in_place=True)
            work = self._gloo.allreduce_coalesced(hosts, gloo_opts)
            return _Then(work, lambda: self._divide(hosts, divisor))

        return self._run("all_reduce_coalesced", tensors, run, tensors,
                         local=lambda: self._scale_local(tensors, factor))

    def reduce(self, tensors, opts):
        gloo_opts, divisor, factor = self._reduce_op("reduce", opts, tensors, dist.ReduceOptions)
        gloo_opts.rootRank, gloo_opts.rootTensor = opts.rootRank, opts.rootTensor
        is_root = self.rank == opts.rootRank

        def run(s):
            # Written back on every rank: Gloo may use a non-root's buffer as scratch, as on the CPU.
            hosts = self._premul([s.write(t, read=True) for t in tensors], factor, in_place=True)
            work = self._gloo.reduce(hosts, gloo_opts)
            return _Then(work, lambda: self._divide(hosts, divisor) if is_root else None)

        return self._run("reduce", tensors, run, tensors, local=lambda: self._scale_local(tensors, factor))

    def _reduce_scatter_base(self, output, input, opts):
        gloo_opts, divisor, factor = self._reduce_op("reduce_scatter_tensor", opts, [input],
                                                     dist.ReduceScatterOptions)

        def run(s):
            out = s.write(output)
            work = self._gloo._reduce_scatter_base(out, self._premul([s.read(input)], factor, False)[0], gloo_opts)
            return _Then(work, lambda: self._divide([out], divisor))

        def local():
            _copy(output, input)
            self._scale_local([output], factor)

        return self._run("reduce_scatter_tensor", [output, input], run, output, local=local)

    def reduce_scatter(self, outputs, input_lists, opts):
        flat_inputs = [t for ts in input_lists for t in ts]
        gloo_opts, divisor, factor = self._reduce_op("reduce_scatter", opts, flat_inputs, dist.ReduceScatterOptions)

        def run(s):
            outs = [s.write(t) for t in outputs]
            ins = [self._premul([s.read(t) for t in ts], factor, False) for ts in input_lists]
            work = self._gloo.reduce_scatter(outs, ins, gloo_opts)
            return _Then(work, lambda: self._divide(outs, divisor))

        def local():
            _copy_each(outputs, [_only(ts) for ts in input_lists])
            self._scale_local(outputs, factor)

        return self._run("reduce_scatter", outputs + flat_inputs, run, outputs, local=local)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        # One Gloo reduce_scatter_tensor of one host buffer: row r holds every input's r-th chunk.
        gloo_opts, divisor, factor = self._reduce_op("reduce_scatter_tensor_coalesced", opts, inputs,
                                                     dist.ReduceScatterOptions)
        sizes = [t.numel() for t in outputs]

        def run(s):
            flat_in = torch.cat([s.read(t).reshape(self.size, n) for t, n in zip(inputs, sizes)], dim=1)
            self._premul([flat_in], factor, in_place=True)  # a new tensor
            flat_out = torch.empty(sum(sizes), dtype=outputs[0].dtype)
            outs = [s.write(t) for t in outputs]
            work = self._gloo._reduce_scatter_base(flat_out, flat_in.reshape(-1), gloo_opts)

            def unpack():
                self._divide([flat_out], divisor)
                for out, part in zip(outs, flat_out.split(sizes)):
                    out.copy_(part.view(out.shape))

            return _Then(work, unpack)

        def local():
            _copy_each(outputs, inputs)
            self._scale_local(outputs, factor)

        return self._run("reduce_scatter_tensor_coalesced", outputs + inputs, run, outputs, local=local)

    # -- data movement -----------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        is_root = self.rank == opts.rootRank

        def run(s):
            hosts = [s.read(t) if is_root else s.write(t) for t in tensors]
            return self._gloo.broadcast(hosts, opts)

        return self._run("broadcast", tensors, run, tensors, local=lambda: None)

    def allgather(self, output_lists, inputs, opts):
        flat = [t for ts in output_lists for t in ts]

        def run(s):
            outs = [[s.write(t) for t in ts] for ts in output_lists]
            return self._gloo.allgather(outs, [s.read(t) for t in inputs], opts)

        return self._run("all_gather", flat + inputs, run, output_lists,
                         local=lambda: _copy_each([_only(ts) for ts in output_lists], inputs))

    def allgather_coalesced(self, output_lists, inputs, opts):
        flat = [t for ts in output_lists for t in ts]

        def run(s):
            outs = [[s.write(t) for t in ts] for ts in output_lists]
            return self._gloo.allgather_coalesced(outs, [s.read(t) for t in inputs], opts)

        return self._run("all_gather_coalesced", flat + inputs, run, output_lists,
                         local=lambda: _copy_each([_only(ts) for ts in output_lists], inputs))

    def _allgather_base(self, output, input, opts):
        def run(s):
            return self._gloo._allgather_base(s.write(output), s.read(input), opts)

        return self._run("all_gather_into_tensor", [output, input], run, output, local=lambda: _copy(output, input))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        # One Gloo all_gather_into_tensor of the concatenated inputs; row r is rank r's inputs.
        sizes = [t.numel() for t in inputs]

        def run(s):
            flat_in = torch.cat([s.read(t).reshape(-1) for t in inputs])
            flat_out = torch.empty(self.size, sum(sizes), dtype=flat_in.dtype)
            outs = [s.write(t) for t in outputs]
            work = self._gloo._allgather_base(flat_out.view(-1), flat_in, opts)

            def unpack():
                for out, part in zip(outs, flat_out.split(sizes, dim=1)):
                    out.copy_(part.reshape(out.shape))

            return _Then(work, unpack)

        return self._run("all_gather_into_tensor_coalesced", outputs + inputs, run, outputs,
                         local=lambda: _copy_each(outputs, inputs))

    def gather(self, output_lists, inputs, opts):
        flat = [t for ts in output_lists for t in ts]

        def run(s):
            outs = [[s.write(t) for t in ts] for ts in output_lists]
            return self._gloo.gather(outs, [s.read(t) for t in inputs], opts)

        return self._run("gather", flat + inputs, run, output_lists,
                         local=lambda: _copy_each([_only(ts) for ts in output_lists], inputs))

    def scatter(self, outputs, input_lists, opts):
        flat = [t for ts in input_lists for t in ts]

        def run(s):
            outs = [s.write(t) for t in outputs]
            return self._gloo.scatter(outs, [[s.read(t) for t in ts] for ts in input_lists], opts)

        return self._run("scatter", outputs + flat, run, outputs,
                         local=lambda: _copy_each(outputs, [_only(ts) for ts in input_lists]))

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        def run(s):
            return self._gloo.alltoall_base(s.write(output), s.read(input), output_splits, input_splits, opts)

        return self._run("all_to_all_single", [output, input], run, output, local=lambda: _copy(output, input))

    def alltoall(self, outputs, inputs, opts):
        # Gloo has only the single-tensor form: one flat buffer each way, split per rank.
        def run(s):
            flat_in = torch.cat([s.read(t).reshape(-1) for t in inputs])
            flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype)
            outs = [s.write(t) for t in outputs]
            work = self._gloo.alltoall_base(flat_out, flat_in, [t.numel() for t in outputs],
                                            [t.numel() for t in inputs], opts)

            def unpack():
                for out, part in zip(outs, flat_out.split([t.numel() for t in outputs])):
                    out.copy_(part.view(out.shape))

            return _Then(work, unpack)

        return self._run("all_to_all", outputs + inputs, run, outputs, local=lambda: _copy_each(outputs, inputs))

    def barrier(self, opts):
        gloo_opts = dist.BarrierOptions()
        gloo_opts.timeout = opts.timeout
        return self._run("barrier", [], lambda s: self._gloo.barrier(gloo_opts), None, local=lambda: None)

    # -- point to point ----------------------------------------------------------------------------
    def send(self, tensors, dst, tag):
        self._enter("send")
        staging = _Staging()
        work = self._gloo.send([staging.read(t) for t in tensors], dst, tag)
        if any(_is_tpu(t) for t in tensors):
            _count("dist_collectives_staged")
        return _PendingWork(self, f"send to rank {dst}", work, staging, tensors)

    def recv(self, tensors, src, tag):
        self._enter("recv")
        staging = _Staging()
        work = self._gloo.recv([staging.write(t) for t in tensors], src, tag)
        if any(_is_tpu(t) for t in tensors):
            _count("dist_collectives_staged")
        return _PendingWork(self, f"recv from rank {src}", work, staging, tensors)

    def recv_anysource(self, tensors, tag):
        self._enter("recv")
        staging = _Staging()
        work = self._gloo.recv_anysource([staging.write(t) for t in tensors], tag)
        if any(_is_tpu(t) for t in tensors):
            _count("dist_collectives_staged")
        return _PendingWork(self, "recv from any rank", work, staging, tensors)

    def options(self):
        return _Options(BACKEND_NAME, self.timeout)

    def split(self, store, ranks, timeout_s: float, group_name: str):
        """The backend of a new group of `ranks` (ranks of this group) made by split_group, or None if this
        rank is not in it."""
        ranks = sorted(ranks)
        # The store is the parent's, shared by every group this split makes at once: each needs its own prefix
        # (every rank of the parent splits in the same order, members or not, so the count agrees).
        self._splits += 1
        if self.rank not in ranks:
            return None
        prefix = f"tpu_dist_split/{self._splits}/{'_'.join(map(str, ranks))}/"
        return _TpuDistBackend(dist.PrefixStore(prefix, store), ranks.index(self.rank), len(ranks),
                               datetime.timedelta(seconds=timeout_s), group_name, [self.global_ranks[r] for r in ranks])

    def set_timeout(self, seconds: float) -> None:
        self.timeout = datetime.timedelta(seconds=seconds)
        self._gloo._set_default_timeout(self.timeout)


class _Options(_C10dBackend.Options):
    """c10d Backend.Options that copy.deepcopy can copy (split_group copies the parent's)."""

    def __deepcopy__(self, memo):
        return _Options(self.backend, self._timeout)


class _Then:
    """A Gloo work and what to do on the host once it is done (AVG's division, unpacking)."""

    def __init__(self, work, after):
        self.work, self.after = work, after

    def wait(self):
        self.work.wait()
        self.after()


def _create_backend(dist_opts, backend_opts):
    """Backend.register_backend's creator (extended API: it also gives the group name and global ranks)."""
    impl = _TpuDistBackend(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout,
                           dist_opts.group_id, dist_opts.global_ranks_in_group)
    return _C._make_dist_backend(dist_opts.group_rank, dist_opts.group_size, impl)


class _BackendConfig(c10d.BackendConfig):
    """init_process_group() without a backend on a tpu machine: tpu_dist for tpu tensors AND Gloo for cpu
    tensors (torch maps only the accelerator's device type), as "cpu:gloo,tpu:tpu_dist"."""

    def __init__(self, backend):
        super().__init__(backend)
        if str(backend) == dist.Backend.UNDEFINED and self.device_backend_map.get("tpu") == BACKEND_NAME:
            self.device_backend_map.setdefault("cpu", dist.Backend(dist.Backend.GLOO))


def _bind_local_device() -> None:
    """torchrun with several devices per process: LOCAL_RANK names this process's device."""
    local_rank = os.environ.get("LOCAL_RANK")
    from . import _settings

    try:
        per_process = _settings.integer("TORCH_PJRT_CPU_DEVICES", 1)
    except ValueError:
        return  # the runtime raises naming the variable when it starts
    if local_rank is not None and per_process > 1:
        torch.tpu.set_device(int(local_rank) % per_process)


def register() -> None:
    if not dist.is_available():
        return
    # "cpu" in devices: init_process_group("tpu_dist") also serves cpu tensors (barrier's default tensor
    # is on the cpu); the default for cpu stays gloo.
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["tpu", "cpu"])
    c10d.BackendConfig = _BackendConfig
    _bind_local_device()
