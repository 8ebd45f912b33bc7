"""``--set key.path=value`` overrides applied to the parsed YAML before it is converted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from unirl.core.errors import ConfigError


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings; values are parsed as YAML (``3``, ``true``, ``[1, 2]``)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return data
