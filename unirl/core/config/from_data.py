"""Conversion of plain data (parsed YAML) to the attrs config classes, with the dotted key path in
every error."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from unirl.core.errors import ConfigError, KeyedConfigError

# Conversion from plain data, with key paths in every error.
# cattrs could structure these classes, but its errors are exception groups without the dotted
# key path and "did you mean" hint our users get here; the converter below is ~80 lines.
# --------------------------------------------------------------------------------------------


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if attrs.has(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value is False and "off" in allowed:
            return "off"  # YAML 1.1 reads an unquoted `off` as false (routing_replay: off)
        if value not in allowed or isinstance(value, bool) != any(
            isinstance(v, bool) for v in allowed
        ):
            raise ConfigError(f"{path}: {value!r} is not valid; choose one of {list(allowed)}")
        return value
    if attrs.has(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {value!r}")
        return _structure(value, tp, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            # YAML 1.1 reads "3e-4" (no dot) as a string; users mean the number.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        item = typing.get_args(tp)[0]
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(f"{path}: expected a list of {_type_name(item)}, got {value!r}")
        return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    raise AssertionError(f"config type {tp!r} at {path} has no converter")


def _structure(
    data: Mapping[str, Any],
    cls: type,
    path: str,
    converted: Mapping[str, Any] | None = None,
    *,
    also_valid: Sequence[str] = (),
) -> Any:
    """``cls`` from ``data`` (keys checked, values converted); ``converted``: keyword arguments
    already built by the caller, which the YAML cannot set directly; ``also_valid``: keys the
    caller took out of ``data`` before (sections of plug-ins), named in an unknown key's hint."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.init and f.name not in (converted or {})}
    kwargs = dict(converted or {})
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            valid = sorted({*fields, *also_valid})
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{full}'{hint}; valid keys here: {valid}")
        kwargs[key] = _convert(value, hints[key], full)
    missing = [n for n, f in fields.items() if f.default is attrs.NOTHING and n not in kwargs]
    if missing:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"{path or 'the config'} has no {where}{missing[0]}, which it needs; set it "
            f"(the section's keys: {sorted(fields)}) or remove {path or 'the section'}"
        )
    try:
        return cls(**kwargs)
    except KeyedConfigError as exc:
        raise (exc.prefixed(path) if path else exc) from None
    except ConfigError as exc:
        msg = str(exc)
        # Field validators know only the field name: prefix the section path.
        if path and not msg.startswith(path) and msg.split(" ")[0].split("=")[0] in fields:
            msg = f"{path}.{msg}"
        raise ConfigError(msg) from None
