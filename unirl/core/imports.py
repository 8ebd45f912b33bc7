"""User components named in a config as ``"package.module:function"`` (custom losses,
advantage estimators, tasks): one importer, so every such key fails the same clear way."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from unirl.core.errors import ConfigError


def import_callable(spec: str, *, key: str, what: str) -> Callable[..., Any]:
    """The callable ``spec`` names; `key` is the config key shown in errors, `what` the kind of
    component (e.g. "a custom loss")."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key}={spec!r} must look like 'package.module:function' for {what}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}={spec!r}: cannot import module {module_name!r} ({e}); make it importable "
            "(installed or on PYTHONPATH)"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def lazy_attributes(
    module_name: str, namespace: dict[str, Any], lazy: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` that import each name of ``lazy`` (name ->
    module) on first use: a package whose import must stay light (no torch) can still offer its
    heavy names at the top."""

    def __getattr__(name: str) -> Any:
        if name not in lazy:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(lazy[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *lazy])

    return __getattr__, __dir__
