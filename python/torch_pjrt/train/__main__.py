"""python -m torch_pjrt.train [CONFIG.yaml] [key=value ...] [--torchrun] [--k8s OUT_DIR] [--print-config] [--describe]

Without a flag it trains in this process (or in each process torchrun started). --torchrun runs
torchrun here with launch.procs_per_node processes; --k8s writes the Kubernetes manifests (a ConfigMap
with the config and a JobSet) to OUT_DIR; --print-config prints the merged config as YAML;
--describe prints the table of keys. Overrides may come before or after the flags. A configuration
error (a bad key or value, a missing file, a mesh that does not fit the processes, a checkpoint of
another run) prints `error: ...` and exits with status 2.
"""
import argparse
import json
import sys

import yaml


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torch_pjrt.train", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="CONFIG.yaml (first, optional) and key=value overrides")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--torchrun", action="store_true", help="launch launch.procs_per_node local processes")
    group.add_argument("--k8s", metavar="OUT_DIR", help="write Kubernetes manifests instead of training")
    group.add_argument("--print-config", action="store_true")
    group.add_argument("--describe", action="store_true", help="print every config key")
    return p


def main(argv=None) -> int:
    # intermixed: `CONFIG --torchrun key=value` gives the overrides to `items`, not an error
    args = _parser().parse_intermixed_args(argv)
    from .config import ConfigError, reference_markdown
    if args.describe:
        print(reference_markdown(), end="")
        return 0
    try:
        return _run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        _leave_process_group()
        return 2


def _run(args) -> int:
    from .config import load_config, to_dict
    items = list(args.items)
    path = items.pop(0) if items and "=" not in items[0] else None
    cfg = load_config(path, items)
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.k8s:
        from .k8s import write_manifests
        for f in write_manifests(cfg, args.k8s):
            print(f)
        return 0
    if args.torchrun:
        return _launch_local(cfg, path, items)
    return _train(cfg)


def _launch_local(cfg, path, items) -> int:
    import subprocess

    from .k8s import torchrun_command
    from .mesh import mesh_shape
    mesh_shape(cfg, cfg.launch.procs_per_node)  # a mesh that cannot fit fails here, not once in every process
    cmd = torchrun_command(cfg, local=True, config_path=path, overrides=items)
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _train(cfg) -> int:
    from .trainer import Trainer
    trainer = Trainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    if trainer.rank == 0 and history:
        print(f"steps {history[0]['step']}..{history[-1]['step']}: loss {history[0]['loss']:.4f} -> "
              f"{history[-1]['loss']:.4f}, {history[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
        # time to the first step (compiles included), compiles, peak device and RSS bytes (max over ranks)
        print("summary: " + json.dumps(trainer.summary), flush=True)
    return 0


def _leave_process_group() -> None:
    """A rank that stops on a config error leaves torchrun's process group cleanly (every rank finds the same
    error, so none waits on another)."""
    dist = sys.modules.get("torch.distributed")  # not imported: no group to leave
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
