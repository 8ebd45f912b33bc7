"""The plug-ins of the two built-in sources without an engine of their own: ``sampler`` (the
policy's copy generates in this process) and ``file`` (finished rollouts read from a file).
Importing this module imports no torch; `unirl.rollouts` registers them (and ``vllm``'s)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import LazySourceBuilder, SourcePlugin

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig


def _describe_sampler(cfg: UnirlConfig) -> Mapping[str, Any]:
    r = cfg.rollout
    episodes = {}
    if r.environment is not None:
        episodes["episodes"] = (
            f"multi-turn against environment {r.environment!r}: up to {r.max_turns} turns of "
            f"{r.max_new_tokens} tokens, {r.max_episode_tokens or cfg.model.max_seq_len} "
            "response tokens in all"
        )
    k = cfg.train.max_staleness
    version = (
        f"generated up to {k} rollout(s) ahead (train.max_staleness={k}): a rollout is up to "
        f"{k * cfg.layout.optimizer_steps_per_rollout} policy version(s) behind the trained policy"
        if k
        else "the weights of the last sync: every rollout is on-policy"
    )
    return {
        "engine": "the built-in sampler: a copy of the policy on every rank",
        "policy_version": version,
        **episodes,
    }


def _check_sampler(cfg: UnirlConfig) -> None:
    if cfg.algorithm.routing_replay == "rollout":
        raise ConfigError(
            "algorithm.routing_replay: rollout replays the experts the rollout engine used, but "
            "the built-in sampler does not record them; use algorithm.routing_replay: record "
            "(the trainer records its own routing), or rollouts from a file that carry "
            "routed_experts (rollout.source: file)"
        )


def _check_file(cfg: UnirlConfig) -> None:
    if not cfg.rollout.file:
        raise ConfigError("rollout.source: file needs rollout.file (a JSONL path)")


def _describe_file(cfg: UnirlConfig) -> Mapping[str, Any]:
    return {
        "policy_version": "each record's 'policy_version' (unknown where the file has none)",
    }


SAMPLER = SourcePlugin(
    name="sampler",
    build=LazySourceBuilder("unirl.rollouts.build:build_sampler_source"),
    check=_check_sampler,
    describe=_describe_sampler,
    requires=("transformers",),
    install_hint="pip install 'unirl[hf]'",
    top_p_logprobs="untruncated",
    runs_episodes=True,
    weights="every_rank",
)

FILE = SourcePlugin(
    name="file",
    build=LazySourceBuilder("unirl.rollouts.build:build_file_source"),
    check=_check_file,
    describe=_describe_file,
    generates=False,
    weights="none",
)
