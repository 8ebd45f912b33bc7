"""Field validators of the config schema: every number is checked where it is declared.

YAML reads ``.inf`` and ``.nan`` as floats and ``--set`` parses its value as YAML, so a float
field can receive a non-finite value that no range check catches (``nan > 0`` is False, but so is
``nan <= 0``). Each validator here rejects non-finite values first, then checks its range, and
names the field; `_structure` in `config` prefixes the section path, so the user reads e.g.
``optimizer.lr must be a finite number > 0, got inf``. `check_hf_config_shape` checks the model
shapes that a random init would otherwise only trip over deep inside a backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from unirl.core.errors import ConfigError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _finite_or_raise(attribute: attrs.Attribute, value: Any, want: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"{attribute.name} must be a finite number{' ' + want if want else ''}, got {value}"
        )


def in_range(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> Validator:
    """A finite number within [low, high] (bounds open where asked); None passes (optional)."""
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    want = " and ".join(parts)
    hint = f" ({why})" if why else ""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        _finite_or_raise(attribute, value, want)
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            raise ConfigError(f"{attribute.name} must be {want}, got {value}{hint}")

    return check


positive = in_range(0, low_open=True)
non_negative = in_range(0)
unit_interval = in_range(0, 1)


def finite(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _finite_or_raise(attribute, value, "")


def adam_betas(instance: Any, attribute: attrs.Attribute, value: tuple[float, float]) -> None:
    for i, beta in enumerate(value):
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and 0 <= beta < 1):
            raise ConfigError(
                f"{attribute.name}={list(value)}: entry {i} ({beta}) must be in [0, 1) (AdamW's "
                "moving-average decays; typical: [0.9, 0.999])"
            )


# keys of a Hugging Face config that must be positive integers when given
_POSITIVE_SHAPES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "head_dim",
)


def check_hf_config_shape(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """Shapes of ``model.hf_config`` (for a random init) that no model can be built with."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.hf_config: expected a mapping, got {value!r}")
    key = "model.hf_config"
    for name in _POSITIVE_SHAPES:
        if name not in value or value[name] is None:
            continue
        v = value[name]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{key}.{name}={v!r} must be a positive integer")
    heads, kv = value.get("num_attention_heads"), value.get("num_key_value_heads")
    hidden = value.get("hidden_size")
    if hidden and heads and value.get("head_dim") is None and hidden % heads:
        raise ConfigError(
            f"{key}.hidden_size={hidden} is not divisible by {key}.num_attention_heads={heads} "
            "(each head gets hidden_size / heads dimensions); choose sizes that divide, or set "
            f"{key}.head_dim"
        )
    if heads and kv and heads % kv:
        raise ConfigError(
            f"{key}.num_attention_heads={heads} is not divisible by {key}.num_key_value_heads={kv} "
            "(grouped-query attention shares each key/value head among heads / kv_heads query "
            "heads); choose a divisor"
        )
