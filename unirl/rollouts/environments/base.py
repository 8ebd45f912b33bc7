"""The environment protocol and its observation and turn types; see `unirl.rollouts.environments`
for the interface."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from unirl.core.errors import ConfigError


@attrs.frozen(kw_only=True)
class Observation:
    """What the environment says back: ``text`` (tokenised once by the run's tokenizer) or
    ``token_ids`` (appended as they are); exactly one of the two."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = attrs.field(
        default=None, converter=lambda v: None if v is None else tuple(int(t) for t in v)
    )

    def __attrs_post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ConfigError("Observation: give exactly one of text and token_ids")


@attrs.frozen(kw_only=True)
class Turn:
    """One policy turn as the engine produced it: its sampled ids (exactly those trained on),
    their decoded text, its index in the episode (0 first) and whether it ended by a stop
    rather than by the token budget."""

    token_ids: tuple[int, ...]
    text: str
    index: int
    finished: bool


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (a new instance per episode)."""

    def reset(self, prompt: str, metadata: Mapping[str, Any]) -> Any: ...

    def step(self, turn: Turn) -> tuple[Any, float, bool]: ...


def as_observation(value: Any, where: str) -> Observation | None:
    """``value`` (an `Observation`, a string, a sequence of ids, or None) as an `Observation`;
    anything else raises `ConfigError` naming ``where`` (the episode and turn)."""
    if value is None or isinstance(value, Observation):
        return value
    if isinstance(value, str):
        return Observation(text=value)
    if isinstance(value, Sequence) and all(isinstance(t, int) for t in value):
        return Observation(token_ids=value)
    if hasattr(value, "tolist"):  # a tensor of ids
        return Observation(token_ids=value.tolist())
    raise ConfigError(
        f"{where}: the environment returned an observation of type {type(value).__name__}; "
        "return text (str), token ids (list[int]), an Observation, or None"
    )
