"""The TORCH_PJRT_* environment variables, read through the one table that documents them.

The table lives in C++ (csrc/graph/settings.cpp), where the runtime reads most of them;
`python -m torch_pjrt` prints it with the values set. Python reads its settings here,
never through os.environ, so a variable missing from the table is a bug that raises.
"""
from __future__ import annotations

import warnings

from . import _C


def table() -> list[tuple[str, str, str, str | None]]:
    """(name, default, what it does, value set or None) for every setting."""
    return [tuple(row) for row in _C._settings()]


def text(name: str) -> str:
    """The value, else the table's default."""
    return _C._setting_text(name)


def flag(name: str) -> bool:
    """An on/off switch. A bad value warns and keeps the default: most are read
    while `import torch` loads this package, which must never raise."""
    try:
        return _C._setting_flag(name)
    except ValueError as e:
        warnings.warn(f"torch_pjrt: {e}; using the default", RuntimeWarning, stacklevel=2)
        default = next(row[1] for row in table() if row[0] == name)
        return default not in ("", "0")


def integer(name: str, minimum: int = -(2**63)) -> int:
    return _C._setting_integer(name, minimum)
