"""Exception types for mistakes a user can fix. Each message names the key or field, the value
seen, and what to set instead; `assert` stays for internal invariants."""

from __future__ import annotations

from collections.abc import Callable


class UnirlError(Exception):
    """Base of every user-facing unirl error."""


class ConfigError(UnirlError, ValueError):
    """A config key is unknown, has the wrong type, or contradicts another key."""


class RolloutDataError(UnirlError, ValueError):
    """A rollout record breaks the data contract (names the sample index and field)."""


class LossInputError(UnirlError, ValueError):
    """A loss, estimator or log-prob function got tensors that do not fit together."""


class RunError(UnirlError, RuntimeError):
    """A run stopped for a reason the user can fix outside the code: a full disk, a rank that
    hung, a run whose loss or weights stopped being finite. Names what happened and what to do;
    the newest complete checkpoint is left intact."""


class StuckCollectiveError(RunError):
    """A rank gave up on a collective that is still pending: the process group cannot be torn
    down cleanly after it (gloo's threads wait in it), so the command exits at once."""


class CollectiveTimeoutError(StuckCollectiveError):
    """A collective waited ``parallel.timeout_s`` for a rank that stopped answering. The process
    group cannot be torn down cleanly after it, so the command exits at once."""


class WaitTimeoutError(StuckCollectiveError):
    """A rank waited past the own deadline of work another rank does (an evaluation, rewards,
    the post-processing hook, a generation: `unirl.rollouts.serving.exchange.RolloutExchange`).
    Its message names what it waited for and the setting; its wait is still pending."""


class KeyedConfigError(ConfigError):
    """A `ConfigError` whose message names its fields through a key function, so that whoever
    knows what the user wrote can name those instead: a settings class says
    ``LossSettings.clip_low``; the config section built on it re-keys the same error to
    ``algorithm.clip_low`` (no string replacement: the message is rendered again).

    ``render(key)`` builds the message, calling ``key(field)`` for each field it names."""

    def __init__(self, render: Callable[[Callable[[str], str]], str], key: Callable[[str], str]):
        self.render = render
        self.key = key
        super().__init__(render(key))

    def rekeyed(self, key: Callable[[str], str]) -> KeyedConfigError:
        """The same error with each field named ``key(field)``."""
        return KeyedConfigError(self.render, key)

    def prefixed(self, path: str) -> KeyedConfigError:
        """The same error with ``path.`` before each key (the section the fields sit in)."""
        return KeyedConfigError(self.render, lambda field: f"{path}.{self.key(field)}")
