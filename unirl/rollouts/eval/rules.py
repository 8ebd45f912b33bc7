"""The config rules of the ``eval:`` section: it generates through the rollout engine on prompts
tokenized as ``rollout.prompts`` are (`unirl.rollouts.eval.evaluator`). Registered in
`unirl.core.config.rules` by `unirl.rollouts`, so they run when the config is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES

if TYPE_CHECKING:  # the config module imports torch; the rules run on a built one
    from unirl.core.config.run_config import UnirlConfig


def check_eval(cfg: UnirlConfig) -> None:
    """eval: runs through the rollout engine on prompts tokenized as rollout.prompts are."""
    e, r = cfg.eval, cfg.rollout
    if e is None:
        return
    if not SOURCES.get(r.source).generates:
        raise ConfigError(
            f"eval: generates held-out responses with the rollout engine, but rollout.source: "
            f"{r.source} reads finished rollouts; use a generating source or remove eval"
        )
    if r.prompts is None:
        raise ConfigError(
            "eval: reads its prompts as rollout.prompts are read (its column mapping, chat "
            f"template and tokenizer), but rollout.prompts is not set (rollout.task={r.task!r} "
            "has no held-out file); train on a prompt dataset or remove eval"
        )
    if cfg.train.max_staleness:
        raise ConfigError(
            f"eval: with train.max_staleness={cfg.train.max_staleness} the rollout engine "
            "belongs to the worker that generates ahead; set train.max_staleness: 0 or remove eval"
        )
    if e.reward is None and r.reward is None:
        raise ConfigError(
            "eval: scores its responses with rollout.reward, which is not set (the episodes of "
            f"rollout.environment={r.environment!r} are scored by its steps); set eval.reward"
        )
    if e.reward is None and e.reward_options:
        raise ConfigError(
            "eval.reward_options are the options of eval.reward, which is not set (the eval "
            "uses rollout.reward with rollout.reward_options); set eval.reward or remove them"
        )
