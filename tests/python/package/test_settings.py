"""The TORCH_PJRT_* settings: one table read by C++ and Python, documented in docs/settings.md."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import torch_pjrt
from torch_pjrt import _C, _settings
from torch_pjrt.__main__ import settings_markdown

pytestmark = pytest.mark.modes_inside  # reads the environment; no execution mode involved

ROOT = pathlib.Path(__file__).resolve().parents[3]
SOURCES = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".h")] + \
    list((ROOT / "python" / "torch_pjrt").rglob("*.py"))


def _names_in_table():
    return {row[0] for row in _settings.table()}


def test_every_variable_the_sources_name_is_in_the_table():
    named = set()
    for path in SOURCES:
        text = path.read_text()
        macros = set(re.findall(r"#\s*(?:define|ifdef|ifndef)\s+(TORCH_PJRT_\w+)", text))
        named |= set(re.findall(r"TORCH_PJRT_[A-Z0-9_]*[A-Z0-9]", text)) - macros
    named -= {"TORCH_PJRT_API_FUNCTION"}  # a macro defined in plugin.cpp, used by name above
    assert named - _names_in_table() == set()


def test_nothing_reads_them_around_the_table():
    direct = re.compile(r"getenv\(\s*\"TORCH_PJRT_|environ(?:\.get)?[\[(]\s*[\"']TORCH_PJRT_")
    readers = [str(p.relative_to(ROOT)) for p in SOURCES
               if p.name not in ("settings.cpp",) and direct.search(p.read_text())]
    assert readers == []


def test_docs_list_the_table():
    assert settings_markdown() in (ROOT / "docs" / "settings.md").read_text()


def test_typed_reads_and_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("TORCH_PJRT_CHECK_NANS", "yes")
    assert _C._setting_flag("TORCH_PJRT_CHECK_NANS") is True
    monkeypatch.setenv("TORCH_PJRT_CHECK_NANS", "Off")
    assert _C._setting_flag("TORCH_PJRT_CHECK_NANS") is False
    monkeypatch.setenv("TORCH_PJRT_CHECK_NANS", "maybe")
    with pytest.raises(ValueError, match="TORCH_PJRT_CHECK_NANS must be 1 or 0"):
        _C._setting_flag("TORCH_PJRT_CHECK_NANS")
    with pytest.warns(RuntimeWarning, match="TORCH_PJRT_CHECK_NANS"):
        assert _settings.flag("TORCH_PJRT_CHECK_NANS") is False  # the default
    monkeypatch.setenv("TORCH_PJRT_FUSION_LIMIT", "12x")
    with pytest.raises(ValueError, match="TORCH_PJRT_FUSION_LIMIT must be a positive integer, got '12x'"):
        _C._setting_integer("TORCH_PJRT_FUSION_LIMIT", 1)
    monkeypatch.delenv("TORCH_PJRT_FUSION_LIMIT")
    assert _C._setting_integer("TORCH_PJRT_FUSION_LIMIT", 1) == 2000
    with pytest.raises(Exception, match="missing from the settings table"):
        _C._setting_text("TORCH_PJRT_NOT_A_SETTING")


def _run(code, **env):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_bad_runtime_setting_raises_at_first_use_naming_it():
    out = _run("import torch, torch_pjrt\n"
               "try:\n    torch.ones(2, device='tpu').sum().item()\nexcept Exception as e:\n    print('ERR', e)\n",
               TORCH_PJRT_CPU_DEVICES="two")
    assert "TORCH_PJRT_CPU_DEVICES must be a positive integer, got 'two'" in out.stdout + out.stderr


def test_bad_import_time_setting_warns_and_torch_still_imports():
    out = _run("import torch, torch_pjrt\nx = torch.arange(4., device='tpu')\nprint('SUM', (x * 2).sum().item())",
               TORCH_PJRT_BATCH_BUCKETS="sometimes")
    assert out.returncode == 0, out.stderr
    assert "SUM 12.0" in out.stdout
    assert "TORCH_PJRT_BATCH_BUCKETS must be 1 or 0" in out.stderr


def test_diagnosis_lists_the_settings_set():
    out = subprocess.run([sys.executable, "-m", "torch_pjrt"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TORCH_PJRT_FUSION_COST="77"))
    assert "setting: TORCH_PJRT_FUSION_COST='77' (default 8192)" in out.stdout
