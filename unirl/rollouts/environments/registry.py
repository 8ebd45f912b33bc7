"""The registry of environments (``rollout.environment``: a registered name or
``package.module:Class``) and the builder of one episode's environment."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from unirl.core.errors import ConfigError
from unirl.core.imports import import_callable
from unirl.core.registry import Registry, same_callable
from unirl.rollouts.environments.base import Environment

KEY = "rollout.environment"


EnvironmentFactory = Callable[..., Environment]


def _load_builtins() -> None:
    from unirl.rollouts.environments.hidden_number import HiddenNumber

    register_environment("hidden_number", HiddenNumber)


ENVIRONMENTS: Registry[EnvironmentFactory] = Registry(
    "environment", key=KEY, same=same_callable, load=_load_builtins
)


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Make ``rollout.environment: name`` build ``factory(**rollout.environment_options)``."""
    ENVIRONMENTS.register(name, factory)


def environment_factory(
    spec: str, options: Mapping[str, Any] | None = None
) -> Callable[[], Environment]:
    """A no-argument builder of the environment ``spec`` names (a registered name or
    ``package.module:Class``) with ``options``; the first instance is built now, so bad options
    fail before the run starts."""
    if ":" in spec:
        factory = import_callable(spec, key=KEY, what="an environment class")
    else:
        factory = ENVIRONMENTS.get(spec, hint="or an environment class as 'package.module:Class'")
    kwargs = dict(options or {})

    def build() -> Environment:
        try:
            env = factory(**kwargs)
        except TypeError as exc:
            raise ConfigError(
                f"rollout.environment_options={kwargs!r} do not fit environment {spec!r}: {exc}"
            ) from None
        if not isinstance(env, Environment):
            raise ConfigError(
                f"{KEY}={spec!r} built a {type(env).__name__}, which lacks reset(prompt, "
                "metadata) and step(turn)"
            )
        return env

    build()
    return build


def make_environment(spec: str, options: Mapping[str, Any] | None = None) -> Environment:
    """One environment instance of ``spec`` with ``options``."""
    return environment_factory(spec, options)()
