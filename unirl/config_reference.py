"""The configuration reference, read from the schema: one entry per key (type, default, allowed
values, the rule that checks it, the comment written beside the field), for every section of
`UnirlConfig`, every backend's section and every rollout source's.

Why from the schema: the defaults and rules live on the attrs classes only, so a hand-written list
of keys would drift the day a key is added. `docs/gen_config_reference.py` writes the whole
reference as ``docs/reference/config.md`` (a test fails when it is stale or a key lacks its
entry); ``unirl check --explain KEY`` prints one entry. Comments are read from the source
(``# ...`` lines right above a field, or above a group of fields that names it, or at the end
of its line); a key that feeds a settings
field (`unirl.core.config.sections.feeds`) without a comment of its own takes that field's.
"""

from __future__ import annotations

import difflib
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

import attrs

from unirl.core.config.run_config import UnirlConfig
from unirl.core.config.sections.feeds import FEEDS
from unirl.core.errors import ConfigError
from unirl.core.maths.kl import KL_ESTIMATORS
from unirl.core.protocols.backend_plugin import BACKENDS
from unirl.core.protocols.source_plugin import SOURCES

# Fields that are not keys a user writes: derived values and the plug-ins' built sections (each
# plug-in's section is listed under its own name instead).
_NOT_KEYS = {(UnirlConfig, "layout"), (UnirlConfig, "backend_options")}
_PLUGIN_SECTION_FIELDS = {"backend_options", "source_options"}

# Keys that hold a name looked up in a dict rather than a `Registry`.
_NAMED_IN = {
    "algorithm.kl_loss.estimator": KL_ESTIMATORS,
    "algorithm.kl_in_reward.estimator": KL_ESTIMATORS,
}


@attrs.frozen
class Entry:
    """One config key as the reference shows it."""

    key: str
    type: str
    default: str
    allowed: str
    rule: str
    doc: str
    section: str


@attrs.frozen
class Section:
    """One YAML section: its key prefix ('' for the top level), the class and its docstring."""

    prefix: str
    cls: type
    doc: str
    entries: tuple[Entry, ...]


def _registries() -> dict[str, Any]:
    """Config key -> the registry its value is looked up in (`import unirl` registered the
    built-in backends and sources; the registries below load their built-ins on first use)."""
    from unirl.core.maths.advantages.registry import ESTIMATORS
    from unirl.core.maths.losses.registry import POLICY_LOSSES
    from unirl.rollouts.data.tasks import TASKS
    from unirl.rollouts.environments.registry import ENVIRONMENTS
    from unirl.rollouts.rewards.registry import REWARDS

    found = {r.key: r for r in (BACKENDS, SOURCES, POLICY_LOSSES, ESTIMATORS, TASKS, REWARDS)}
    found[ENVIRONMENTS.key] = ENVIRONMENTS
    return found


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the ``#`` comment written above it (contiguous lines) or at the end of its
    line, read from the class's source."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    names = {f.name for f in attrs.fields(cls)}
    found: dict[str, str] = {}
    group = ""  # a comment block above a field covers the next fields that it names, too
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            group = ""
            continue
        head = line[4:].split(":", 1)[0] if line.startswith("    ") and ":" in line else ""
        if line[4:5].isspace() or head not in names or head in found:
            continue
        above = []
        previous = number - 1
        while previous in comments and lines[previous - 1].strip().startswith("#"):
            above.insert(0, comments[previous])
            previous -= 1
        if above:
            group = " ".join(above)
        inline = comments.get(number, "")
        inline = "" if "noqa" in inline or "type: ignore" in inline else inline
        shared = group if above or head in group else ""
        text = " ".join(filter(None, (shared, inline)))
        if text:
            found[head] = text
    return found


def _plain(tp: Any) -> Any:
    """``tp`` without None in a union (the part that says what a value is)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return "null" if tp is type(None) else tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None and args:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return str(tp).replace("typing.", "")


def _literals(tp: Any) -> list[Any]:
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [v for a in typing.get_args(tp) for v in _literals(a)]
    return []


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, default=str)


def _default(field: attrs.Attribute, owner: Any = None) -> str:
    """The field's default; ``owner``: the instance its section's parent builds by default (a
    section may default to other values than its class: the critic's optimizer has its own lr)."""
    if owner is not None:
        return (
            "(section)"
            if attrs.has(type(getattr(owner, field.name)))
            else _show(getattr(owner, field.name))
        )
    default = field.default
    if default is attrs.NOTHING:
        return "required"
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        if default.takes_self:
            return "derived"
        default = default.factory()
    if attrs.has(type(default)):
        return "(section)"
    return _show(default)


def _rule(validator: Any) -> str:
    """A readable name of an attrs validator: its function name and the values it closes over
    (``in_range(low=0, high=1, low_open=True)``)."""
    if validator is None:
        return ""
    inner = getattr(validator, "_validators", None)  # attrs.validators.and_
    if inner is not None:
        return "; ".join(filter(None, (_rule(v) for v in inner)))
    name = getattr(validator, "__qualname__", type(validator).__name__)
    outer = name.split(".<locals>")[0]
    if inspect.isfunction(validator) and validator.__closure__:
        bound = inspect.getclosurevars(validator).nonlocals
        if isinstance(bound.get("want"), str) and bound["want"]:
            return f"{outer}: {bound['want']}"
        shown = ", ".join(f"{k}={v!r}" for k, v in bound.items() if not callable(v))
        return f"{outer}({shown})"
    return outer.lstrip("_")


def _allowed(key: str, tp: Any, registries: dict[str, Any]) -> str:
    literals = _literals(tp)
    if literals:
        return ", ".join(_show(v) for v in literals)
    if key in registries:
        return "registered: " + ", ".join(registries[key].names())
    if key in _NAMED_IN:
        return ", ".join(sorted(_NAMED_IN[key]))
    return ""


def _feeds_comment(field: attrs.Attribute) -> str:
    feeds = field.metadata.get(FEEDS)
    if feeds is None:
        return ""
    settings, name = feeds
    return field_comments(settings).get(name, "")


def _nested_default(field: attrs.Attribute, owner: Any) -> Any:
    """The instance a nested section holds by default, or None (an optional section)."""
    if owner is not None:
        return getattr(owner, field.name)
    default = field.default
    if isinstance(default, attrs.Factory) and not default.takes_self:  # type: ignore[arg-type]
        return default.factory()
    return None


def _walk(
    cls: type, prefix: str, registries: dict[str, Any], owner: Any = None
) -> Iterator[Section]:
    """``cls``'s section and, depth first, the sections its fields hold; ``owner``: the instance
    the parent section holds by default (its values are the defaults shown)."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    entries: list[Entry] = []
    nested: list[tuple[type, str, Any]] = []
    for field in attrs.fields(cls):
        if (cls, field.name) in _NOT_KEYS or field.name in _PLUGIN_SECTION_FIELDS:
            continue
        key = f"{prefix}{field.name}"
        tp = hints[field.name]
        if attrs.has(_plain(tp)):
            nested.append((_plain(tp), f"{key}.", _nested_default(field, owner)))
            if _plain(tp) is not tp:  # an optional section (eval): None turns it off
                entries.append(_entry(key, tp, field, comments, registries, prefix, owner))
            continue
        entries.append(_entry(key, tp, field, comments, registries, prefix, owner))
    yield Section(prefix.rstrip("."), cls, inspect.getdoc(cls) or "", tuple(entries))
    for sub_cls, sub_prefix, sub_owner in nested:
        yield from _walk(sub_cls, sub_prefix, registries, sub_owner)


def _entry(
    key: str,
    tp: Any,
    field: attrs.Attribute,
    comments: dict[str, str],
    registries: dict[str, Any],
    prefix: str,
    owner: Any = None,
) -> Entry:
    return Entry(
        key=key,
        type=_type_name(tp),
        default=_default(field, owner),
        allowed=_allowed(key, tp, registries),
        rule=_rule(field.validator),
        doc=comments.get(field.name) or _feeds_comment(field),
        section=prefix.rstrip("."),
    )


def sections() -> list[Section]:
    """Every section a config can hold: `UnirlConfig`'s, then each backend's (its YAML key is its
    name), then each rollout source's (``rollout.<name>``)."""
    registries = _registries()
    found = list(_walk(UnirlConfig, "", registries))
    for name in BACKENDS.names():
        found += _walk(BACKENDS.get(name).options, f"{name}.", registries)
    for name in SOURCES.names():
        options = SOURCES.get(name).options
        if options is not None:
            found += _walk(options, f"rollout.{name}.", registries)
    return found


def entries() -> dict[str, Entry]:
    """Key -> its entry, for every key of every section."""
    return {e.key: e for s in sections() for e in s.entries}


def explain(key: str) -> str:
    """One key's entry as text (``unirl check --explain KEY``); an unknown key is a
    `ConfigError` with the closest keys."""
    found = entries()
    if key not in found:
        close = difflib.get_close_matches(key, found, n=3, cutoff=0.5)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(
            f"--explain {key!r}: not a config key{hint}; every key: docs/reference/config.md"
        )
    e = found[key]
    rows = [("type", e.type), ("default", e.default), ("allowed", e.allowed), ("rule", e.rule)]
    text = [e.key] + [f"  {name}: {value}" for name, value in rows if value]
    if e.doc:
        text.append(textwrap.fill(e.doc, 96, initial_indent="  ", subsequent_indent="  "))
    return "\n".join(text)
