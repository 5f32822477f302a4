"""Gives each torchrun-started process its own chip, then runs the trainer in it.

    python -m torch.distributed.run --nproc-per-node=4 ... -m torch_pjrt.train.k8s_env \\
        --kind tpu --topology 2x4 --hosts HOST0,HOST1 -- CONFIG.yaml key=value ...

torchrun starts every local rank with the same environment, so without help every process on a host
would open the same accelerators. This wrapper reads LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun) and the
host's index in its slice (JOB_COMPLETION_INDEX, which Kubernetes sets in each pod of an Indexed Job;
--host-index elsewhere), adds the per-process variables below, and replaces itself with
`python -m torch_pjrt.train ARGS`:

- tpu, one process per chip (libtpu reads these when its client starts): TPU_VISIBLE_CHIPS (this
  process's chip on the host), TPU_CHIPS_PER_PROCESS_BOUNDS=1,1,1, TPU_PROCESS_BOUNDS (the grid of
  processes; with one chip each it is the slice's topology), TPU_PROCESS_ADDRESSES (host:port of every
  process of the slice, host-major), TPU_PROCESS_PORT (this process's port in that list) and
  CLOUD_TPU_TASK_ID (this process's index in that list). Each slice is its own libtpu job: the
  trainer's collectives between processes go through torch.distributed (tpu_dist), not through libtpu.
- gpu: CUDA_VISIBLE_DEVICES, the local rank's entry of the container's GPUs, so each process's CUDA
  plugin sees one GPU (tpu:0).

Replacing the process (exec) rather than setting os.environ here: the variables are then in place
before anything in the new interpreter could load the plugin, whatever its imports do.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

__all__ = ["TPU_BASE_PORT", "parse_topology", "tpu_process_env", "gpu_process_env", "process_env", "main"]

# libtpu's usual first per-process port; ports base .. base + procs_per_host - 1 must be free on every host
TPU_BASE_PORT = 8476

# chips of one host (VM) as a grid, by chips per host: GKE's TPU VMs have 1, 4 (2x2) or 8 (2x4) chips
CHIPS_PER_HOST_BOUNDS = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


def parse_topology(text: str) -> tuple[int, int, int]:
    """'2x4' -> (2, 4, 1); '2x2x2' -> (2, 2, 2) (GKE's cloud.google.com/gke-tpu-topology)."""
    parts = text.lower().split("x")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"TPU topology {text!r}: expected AxB or AxBxC with positive integers")
    dims = [int(p) for p in parts] + [1] * (3 - len(parts))
    return dims[0], dims[1], dims[2]


def tpu_process_env(topology: str, hosts: list[str], host_index: int, local_rank: int, procs_per_host: int,
                    base_port: int = TPU_BASE_PORT) -> dict[str, str]:
    """libtpu's settings for process `local_rank` of host `host_index` of a slice, one chip per process."""
    bounds = parse_topology(topology)
    if math.prod(bounds) != len(hosts) * procs_per_host:
        raise ValueError(f"TPU topology {topology} has {math.prod(bounds)} chips, but {len(hosts)} host(s) x "
                         f"{procs_per_host} process(es) were asked for (one process per chip)")
    if not (0 <= host_index < len(hosts) and 0 <= local_rank < procs_per_host):
        raise ValueError(f"host {host_index} of {len(hosts)}, local rank {local_rank} of {procs_per_host}: out of range")
    ports = [base_port + r for r in range(procs_per_host)]
    return {
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": ",".join(str(d) for d in bounds),
        "TPU_PROCESS_ADDRESSES": ",".join(f"{host}:{port}" for host in hosts for port in ports),
        "TPU_PROCESS_PORT": str(ports[local_rank]),
        "CLOUD_TPU_TASK_ID": str(host_index * procs_per_host + local_rank),
    }


def gpu_process_env(local_rank: int, procs_per_host: int, visible: str | None = None) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for one local rank: its entry of the GPUs the container already sees, if listed."""
    ids = [v for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(procs_per_host)]
    if not 0 <= local_rank < len(ids):
        raise ValueError(f"local rank {local_rank}, but the container's CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)}")
    return {"CUDA_VISIBLE_DEVICES": ids[local_rank].strip()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_pjrt.train.k8s_env", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("tpu", "gpu"), required=True)
    p.add_argument("--topology", help="tpu: the slice's topology (AxB or AxBxC)")
    p.add_argument("--hosts", help="tpu: the slice's hosts in index order, comma separated")
    p.add_argument("--host-index", type=int, help="tpu: this host's index in --hosts (default: JOB_COMPLETION_INDEX)")
    p.add_argument("--port", type=int, default=TPU_BASE_PORT, help="tpu: the first process's port on each host")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the trainer's arguments")
    return p


def _int_env(environ, name: str) -> int:
    value = environ.get(name)
    if value is None or not value.strip().isdigit():
        raise SystemExit(f"error: {name}={value!r}: expected a non-negative integer (is this process started by torchrun "
                         "in a pod of an Indexed Job?)")
    return int(value)


def process_env(args: argparse.Namespace, environ) -> dict[str, str]:
    """The variables this process adds to `environ` (the wrapper's parsed arguments)."""
    local_rank, procs = _int_env(environ, "LOCAL_RANK"), _int_env(environ, "LOCAL_WORLD_SIZE")
    if args.kind == "gpu":
        return gpu_process_env(local_rank, procs, environ.get("CUDA_VISIBLE_DEVICES"))
    if not args.topology or not args.hosts:
        raise SystemExit("error: --kind tpu needs --topology and --hosts")
    host_index = args.host_index if args.host_index is not None else _int_env(environ, "JOB_COMPLETION_INDEX")
    return tpu_process_env(args.topology, args.hosts.split(","), host_index, local_rank, procs, args.port)


def main(argv=None, environ=None, execvpe=os.execvpe) -> None:
    args = _parser().parse_args(argv)
    environ = os.environ if environ is None else environ
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    try:
        added = process_env(args, environ)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    # one line per process in the pod's log: which chip or GPU it took
    print(f"k8s_env: local rank {environ.get('LOCAL_RANK')}: " + " ".join(f"{k}={v}" for k, v in added.items()),
          file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "torch_pjrt.train", *rest]
    execvpe(command[0], command, {**environ, **added})


if __name__ == "__main__":
    main()
