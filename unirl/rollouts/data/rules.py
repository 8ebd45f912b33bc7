"""The config rules of prompt data: ``rollout.prompts`` and the keys that only mean something
with it (its reward, column mapping, chat template, tokenizer), and the stop sequences
(``rollout.stop``, ``rollout.stop_token_ids``). Registered in `unirl.core.config.rules` by
`unirl.rollouts`, so they run when the config is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES

if TYPE_CHECKING:  # the config module imports torch; the rules run on a built one
    from unirl.core.config.run_config import UnirlConfig


def check_prompts(cfg: UnirlConfig) -> None:
    """rollout.prompts and the keys that only mean something with it."""
    r = cfg.rollout
    if r.prompts is None:
        for key, value in (
            ("rollout.reward", r.reward),
            ("rollout.reward_options", r.reward_options or None),
            ("rollout.reward_workers", r.reward_workers or None),
            ("rollout.skip_long_prompts", r.skip_long_prompts or None),
            ("model.tokenizer", cfg.model.tokenizer),
            ("rollout.prompt_key", None if r.prompt_key == "prompt" else r.prompt_key),
            ("rollout.answer_key", r.answer_key),
            ("rollout.metadata_keys", r.metadata_keys or None),
            ("rollout.apply_chat_template", r.apply_chat_template or None),
            ("rollout.system_prompt", r.system_prompt),
        ):
            if value is not None:
                raise ConfigError(
                    f"{key}={value!r} applies to prompts read from a file, but rollout.prompts "
                    f"is not set (the built-in tasks score and tokenize themselves); set "
                    f"rollout.prompts or remove {key}"
                )
        return
    if not SOURCES.get(r.source).generates:
        raise ConfigError(
            f"rollout.prompts is read by a generating source, but rollout.source: {r.source} "
            "trains on finished rollouts; remove rollout.prompts or set rollout.source: sampler"
        )
    if r.reward is None and r.environment is None:  # an environment's steps score episodes
        raise ConfigError(
            "rollout.prompts needs rollout.reward: a registered reward such as math_answer, or "
            "'package.module:function' (or rollout.environment, whose steps score episodes)"
        )
    if r.task_options:
        raise ConfigError(
            "rollout.task_options configure rollout.task, which rollout.prompts replaces; remove "
            "rollout.task_options"
        )


def check_stops(cfg: UnirlConfig) -> None:
    """rollout.stop / rollout.stop_token_ids: only for a generating source, none empty or
    negative."""
    r = cfg.rollout
    if not SOURCES.get(r.source).generates and (r.stop or r.stop_token_ids):
        raise ConfigError(
            f"rollout.stop / rollout.stop_token_ids end generation, but rollout.source: "
            f"{r.source} trains on finished rollouts; remove them or use a generating source"
        )
    for i, text in enumerate(r.stop):
        if not text:
            raise ConfigError(f"rollout.stop[{i}] is empty; give a non-empty stop string")
    for i, token in enumerate(r.stop_token_ids):
        if token < 0:
            raise ConfigError(f"rollout.stop_token_ids[{i}]={token}; token ids are >= 0")
