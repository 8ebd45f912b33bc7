"""The config rules of multi-turn episodes: ``rollout.environment`` and the keys that only mean
something with it. Registered in `unirl.core.config.rules` by `unirl.rollouts`, so they run when
the config is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.config.sections.rollout import RolloutConfig
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES
from unirl.rollouts.environments.registry import ENVIRONMENTS

if TYPE_CHECKING:  # the config module imports torch; the rules run on a built one
    from unirl.core.config.run_config import UnirlConfig

# The keys that configure an episode; each must keep its default without an environment.
EPISODE_KEYS = (
    "environment_options",
    "max_turns",
    "max_episode_tokens",
    "env_step_timeout_s",
    "env_failure_reward",
)


def check_environment(cfg: UnirlConfig) -> None:
    """rollout.environment and the keys that only mean something with it."""
    r, default = cfg.rollout, RolloutConfig()
    if r.environment is None:
        for key in EPISODE_KEYS:
            if getattr(r, key) != getattr(default, key):
                raise ConfigError(
                    f"rollout.{key}={getattr(r, key)!r} applies to multi-turn episodes, but "
                    "rollout.environment is not set; set rollout.environment or remove the key"
                )
        return
    if ":" not in r.environment:  # a name (not a class path): registered, or refused here
        ENVIRONMENTS.get(r.environment, hint="or an environment class as 'package.module:Class'")
    if not SOURCES.get(r.source).runs_episodes:
        episodic = " or ".join(sorted(p.name for p in SOURCES.values() if p.runs_episodes))
        raise ConfigError(
            f"rollout.environment={r.environment!r}: rollout.source: {r.source} does not run "
            f"multi-turn episodes; set rollout.source: {episodic}, or remove rollout.environment"
        )
    if r.prompts is not None and r.reward is not None:
        # the episodes' rewards are the environment's steps'; a reward function would go unused
        raise ConfigError(
            f"rollout.reward={r.reward!r} with rollout.environment={r.environment!r}: the "
            "environment's step rewards score each episode (its problems' metadata reach its "
            "reset); remove rollout.reward"
        )
    if r.max_episode_tokens is not None and r.max_episode_tokens < r.max_new_tokens:
        raise ConfigError(
            f"rollout.max_episode_tokens={r.max_episode_tokens} is below rollout.max_new_tokens="
            f"{r.max_new_tokens} (one turn's budget); raise it or leave it out"
        )
