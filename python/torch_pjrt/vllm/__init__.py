"""vLLM on the `tpu` device: an out-of-tree vLLM platform (docs/serving.md, docs/design/vllm-facts.md).

vLLM finds it through the `vllm.platform_plugins` entry point `torch_pjrt = "torch_pjrt.vllm:register"`
(pyproject.toml). `register()` answers the class to use, or None to step aside:

- TORCH_PJRT_VLLM=0 (or false/no/off): step aside, always.
- TORCH_PJRT_VLLM=1: take the platform whenever the device can start, even where vLLM's own TPU platform
  (libtpu importable) would otherwise be the right one.
- unset: take it when the `tpu` device can start, unless VLLM_TARGET_DEVICE names another device than
  "tpu" (VLLM_TARGET_DEVICE=cpu never even asks plugins), or `libtpu` is importable while TORCH_PJRT_PLUGIN
  is unset: a real TPU host, where vLLM's own TPU platform (its built-in detector fires on `import libtpu`)
  is wanted. Setting TORCH_PJRT_PLUGIN (e.g. to `tpu`, torch_pjrt over libtpu) chooses torch_pjrt there.

"Can start" is what torch_pjrt knows at import without starting a PJRT client: its settings are valid and
the plugin's .so is found (torch_pjrt.unavailable_reason is None). The client itself starts in the
worker process, on the first tensor; starting it here would take device memory in the front-end process.

This module imports neither vllm nor torch_pjrt at import: vLLM imports every plugin of the group in every
process, and a plugin that steps aside must cost nothing.
"""
from __future__ import annotations

import importlib.util
import logging
import os

PLATFORM = "torch_pjrt.vllm.platform.TpuPlatform"

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

logger = logging.getLogger(__name__)


def _reason_to_step_aside() -> str | None:
    try:
        import torch_pjrt
        from torch_pjrt import _settings
    except Exception as e:  # noqa: BLE001 - a plugin probe must never raise
        return f"torch_pjrt does not import: {e!r}"
    choice = _settings.text("TORCH_PJRT_VLLM").strip().lower()
    if choice in _OFF:
        return "TORCH_PJRT_VLLM=" + choice
    if choice not in _ON:
        target = os.environ.get("VLLM_TARGET_DEVICE", "").strip().lower()
        if target and target != "tpu":
            return f"VLLM_TARGET_DEVICE={target}"
        plugin_set = any(row[0] == "TORCH_PJRT_PLUGIN" and row[3] is not None for row in _settings.table())
        if importlib.util.find_spec("libtpu") is not None and not plugin_set:
            return "libtpu is installed: vLLM's own TPU platform is wanted (TORCH_PJRT_VLLM=1 overrides)"
    if torch_pjrt.unavailable_reason is not None:
        return torch_pjrt.unavailable_reason
    return None


def register() -> str | None:
    """The `vllm.platform_plugins` entry point: the platform class's qualified name, or None."""
    reason = _reason_to_step_aside()
    if reason is not None:
        logger.debug("torch_pjrt's vLLM platform steps aside: %s", reason)
        return None
    return PLATFORM
