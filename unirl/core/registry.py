"""One small registry type for everything chosen by name: policy losses, advantage estimators,
rollout tasks, training backends.

A registry maps a name to an entry, refuses a second entry under a taken name (a module imported
twice, or under a second name, may re-register an *equal* entry), and answers an unknown name
with a `ConfigError` that names the config key, the value, the valid names and the closest one.
Why one type: the loss and estimator registries used to do this job two ways, each with its own
error wording; the config now takes every set of valid names from here.

    LOSSES = Registry("policy loss", key="algorithm.policy_loss")
    LOSSES.register("ppo_clip", ppo_clip_loss)
    LOSSES.get("ppo_clpi")   # ConfigError: ... (did you mean 'ppo_clip'?); valid: [...]
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from unirl.core.errors import ConfigError

T = TypeVar("T")


def same_callable(a: Any, b: Any) -> bool:
    """Whether two registered functions or classes are the same one: a module reloaded (or
    imported under a second name) re-registers an equal one; two lambdas cannot be told apart
    that way, so they count as different."""
    key = lambda f: (getattr(f, "__module__", None), getattr(f, "__qualname__", None))  # noqa: E731
    return a is b or (key(a) == key(b) and "<lambda>" not in str(key(a)[1]))


class Registry(Generic[T]):
    """Name -> entry. ``kind`` says what the entries are (for messages), ``key`` is the config key
    that names one, ``same`` decides whether a second registration of a name is the same entry
    (default ``==``), and ``load`` imports the modules that register the built-in entries (run once,
    on the first lookup, so that building the registry imports nothing heavy)."""

    def __init__(
        self,
        kind: str,
        *,
        key: str,
        same: Callable[[T, T], bool] | None = None,
        load: Callable[[], None] | None = None,
    ) -> None:
        self.kind = kind
        self.key = key
        self._same = same or (lambda a, b: a == b)
        self._load = load
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; a different entry under a taken name is refused."""
        old = self._entries.get(name)
        if old is not None and not self._same(old, entry):
            raise ConfigError(
                f"{self.kind} {name!r} is already registered ({old!r}); pick another name"
            )
        self._entries[name] = entry
        return entry

    def _loaded(self) -> dict[str, T]:
        if self._load is not None:
            load, self._load = self._load, None
            load()
        return self._entries

    def get(self, name: str, *, hint: str = "") -> T:
        """The entry of ``name``; an unknown name raises `ConfigError` (``hint``: what else the key
        accepts, e.g. "or a custom 'package.module:function'")."""
        entries = self._loaded()
        if name in entries:
            return entries[name]
        close = difflib.get_close_matches(str(name), entries, n=1)
        did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
        extra = f", {hint}" if hint else ""
        raise ConfigError(
            f"{self.key}={name!r} is not a registered {self.kind}{did_you_mean}; "
            f"valid: {self.names()}{extra}"
        )

    def find(self, name: str) -> T | None:
        """The entry of ``name``, or None (for callers that accept other spellings too)."""
        return self._loaded().get(name)

    def names(self) -> list[str]:
        """The registered names, sorted (what an error lists as valid)."""
        return sorted(self._loaded())

    def values(self) -> list[T]:
        return [self._loaded()[n] for n in self.names()]

    def in_order(self) -> list[T]:
        """The entries in the order they were registered (for entries that run in sequence,
        as config rules do: which error a config meets first stays fixed)."""
        return list(self._loaded().values())

    def unregister(self, name: str) -> None:
        """Remove ``name`` (tests that register a temporary entry clean up with this)."""
        self._entries.pop(name, None)

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Registry[T]]:
        """A temporary scope: entries registered inside it are gone after it (tests)."""
        saved = dict(self._loaded())
        try:
            yield self
        finally:
            self._entries = saved

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
