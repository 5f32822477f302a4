"""python -m torch_pjrt.train [CONFIG.yaml] [key=value ...] [--torchrun] [--k8s OUT_DIR] [--print-config] [--describe]

Without a flag it trains in this process (or in each process torchrun started). --torchrun runs
torchrun here with launch.procs_per_node processes; --k8s writes the Kubernetes manifests (a ConfigMap
with the config and a JobSet) to OUT_DIR; --print-config prints the merged config as YAML;
--describe prints the table of keys.
"""
import argparse
import json
import sys

import yaml


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_pjrt.train", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", help="CONFIG.yaml (first, optional) and key=value overrides")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--torchrun", action="store_true", help="launch launch.procs_per_node local processes")
    group.add_argument("--k8s", metavar="OUT_DIR", help="write Kubernetes manifests instead of training")
    group.add_argument("--print-config", action="store_true")
    group.add_argument("--describe", action="store_true", help="print every config key")
    args = p.parse_args(argv)

    from .config import ConfigError, load_config, reference_markdown, to_dict
    if args.describe:
        print(reference_markdown(), end="")
        return 0
    items = list(args.items)
    path = items.pop(0) if items and "=" not in items[0] else None
    try:
        cfg = load_config(path, items)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.k8s:
        from .k8s import write_manifests
        for f in write_manifests(cfg, args.k8s):
            print(f)
        return 0
    if args.torchrun:
        import subprocess
        from .k8s import torchrun_command
        cmd = torchrun_command(cfg, local=True, config_path=path, overrides=items)
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd)

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


if __name__ == "__main__":
    sys.exit(main())
