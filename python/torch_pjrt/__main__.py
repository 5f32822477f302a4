"""`python -m torch_pjrt`: what torch_pjrt finds on this machine, one fact a line.
`python -m torch_pjrt --settings`: the TORCH_PJRT_* environment variables (docs/settings.md).

Every line is `name: value`; a failure to start the device is printed, not raised,
so the report says what is wrong. The last line is `health: ok` and the exit status 0
when the device started, else `health: ...` and exit status 1: a health check (a
Kubernetes probe, a CI step) can run it as it is.
"""
from __future__ import annotations

import os
import sys


def _directory_size(path: str) -> tuple[int, int]:
    files = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.path.getsize(os.path.join(root, name))
                files += 1
            except OSError:
                pass  # removed while we walked (another process evicting)
    return files, size


def diagnosis() -> list[tuple[str, str]]:
    import torch

    import torch_pjrt
    from torch_pjrt import _C

    facts = [("torch_pjrt", os.path.dirname(torch_pjrt.__file__)),
             ("torch_pjrt version", torch_pjrt.__version__),
             ("torch", f"{torch.__version__} ({os.path.dirname(torch.__file__)})"),
             ("python", sys.version.split()[0]),
             ("plugin", _C._plugin_path() or "none"),
             ("plugin variable", f"TORCH_PJRT_PLUGIN={_C._setting_text('TORCH_PJRT_PLUGIN')}")]
    from torch_pjrt import _settings

    for name, default, _, value in _settings.table():
        if value is not None:
            facts.append(("setting", f"{name}={value!r} (default {default})"))
    if torch_pjrt.unavailable_reason:
        facts.append(("unavailable", torch_pjrt.unavailable_reason))
    try:
        info = torch_pjrt.platform()
        facts += [("platform", f"{info['name']} {info['version']}"),
                  ("plugin version", info["version"]),
                  ("device kind", info["device_kind"]),
                  ("PJRT C API version", info["api_version"]),
                  ("devices", f"{torch.tpu.device_count()} ({', '.join(f'tpu:{i}' for i in range(torch.tpu.device_count()))})")]
    except RuntimeError as e:
        facts.append(("device error", str(e).splitlines()[0]))
    facts.append(("mode", torch_pjrt.get_mode()))
    cache = _C._compile_cache_dir()
    if cache:
        files, size = _directory_size(cache) if os.path.isdir(cache) else (0, 0)
        facts.append(("compile cache", f"{cache} ({files} files, {size} bytes)"))
    else:
        facts.append(("compile cache", "memory only (TORCH_PJRT_CACHE_DIR is empty: unset it for ~/.cache/torch_pjrt)"))
    from importlib.metadata import entry_points

    points = [f"{p.name} = {p.value}" for p in entry_points(group="torch.backends") if p.value.startswith("torch_pjrt")]
    facts.append(("torch.backends entry point", points[0] if points else "not installed (pip install --no-build-isolation .)"))
    autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") == "1"
    facts.append(("autoload at import torch", "on" if autoload else "off (TORCH_DEVICE_BACKEND_AUTOLOAD=0)"))
    return facts


def health(facts: list[tuple[str, str]]) -> str:
    """`ok`, or why the device cannot be used, from diagnosis()'s facts: it prints a device that cannot start
    (a bad TORCH_PJRT_PLUGIN, a plugin that fails to load or to create its client) instead of raising."""
    named = dict(facts)
    for failure in ("device error", "unavailable"):
        if failure in named:
            return named[failure]
    if named.get("devices", "").startswith("0 "):
        return "the plugin has no devices"
    return "ok"


def settings_markdown() -> str:
    """The settings table as docs/settings.md has it (a test keeps the two equal)."""
    from torch_pjrt import _settings

    lines = ["| variable | default | what it does |", "|---|---|---|"]
    lines += [f"| `{name}` | {default or '(unset)'} | {what} |" for name, default, what, _ in _settings.table()]
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:] == ["--settings"]:
        print(settings_markdown(), end="")
        return
    facts = diagnosis()
    for name, value in facts:
        print(f"{name}: {value}")
    status = health(facts)
    print(f"health: {status}")
    sys.exit(0 if status == "ok" else 1)


if __name__ == "__main__":
    main()
