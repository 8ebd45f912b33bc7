"""Config keys declared on the settings fields they set: one source for each default and rule.

The loss and advantage libraries' settings classes (`LossSettings`, `AdvantageSettings`) own the
default and the validation of every algorithm value, because the libraries are used without a
config too (`unirl.losses`). A config section only says which YAML key sets which settings field:

    clip_low: float = LOSS.clip_low            # algorithm.clip_low sets LossSettings.clip_low
    estimator: str = ADVANTAGE.kl_in_reward_estimator

so the key is spelled once (the config field) and the settings field is referenced, not named in
a string (a typo is an AttributeError at import). `build_settings` reads the values back and
builds the settings; their errors are re-keyed to the keys the user wrote (`KeyedConfigError`).
"""

from __future__ import annotations

import typing
from typing import Any, TypeVar

import attrs

from unirl.core.errors import KeyedConfigError

# attrs metadata key of a config field that feeds a settings field: (settings class, field name).
FEEDS = "unirl.feeds"

_Settings = TypeVar("_Settings")


class Feeding:
    """``Feeding(LossSettings).clip_low`` is an attrs field whose default is
    ``LossSettings.clip_low``'s and whose value `build_settings` passes to that field."""

    def __init__(self, settings: type) -> None:
        self._settings = settings

    def __getattr__(self, name: str) -> Any:
        source = getattr(attrs.fields(self._settings), name)
        return attrs.field(default=source.default, metadata={FEEDS: (self._settings, name)})


def fed_fields(section: type, settings: type, prefix: str = "") -> dict[str, str]:
    """Each field of ``settings`` that ``section`` (or one of its sub-sections) feeds -> the key,
    relative to ``section``, that sets it (``kl_loss_coef`` -> ``kl_loss.coef``)."""
    hints = typing.get_type_hints(section)
    found = {}
    for field in attrs.fields(section):
        feeds = field.metadata.get(FEEDS)
        if feeds is not None and feeds[0] is settings:
            found[feeds[1]] = f"{prefix}{field.name}"
        elif attrs.has(hints[field.name]):
            found.update(fed_fields(hints[field.name], settings, f"{prefix}{field.name}."))
    return found


def _read(section: Any, key: str) -> Any:
    for part in key.split("."):
        section = getattr(section, part)
    return section


def build_settings(section: Any, settings: type[_Settings], **resolved: Any) -> _Settings:
    """``settings`` built from the values ``section`` feeds it (the other fields keep the
    settings' defaults); ``resolved``: values the section's owner worked out for fields whose key
    takes more than the settings field does (``algorithm.decoupled: auto``). An error names the
    key relative to ``section``."""
    keys = fed_fields(type(section), settings)
    try:
        return settings(
            **{field: resolved.get(field, _read(section, key)) for field, key in keys.items()}
        )
    except KeyedConfigError as exc:
        raise exc.rekeyed(lambda field: keys[field]) from None
