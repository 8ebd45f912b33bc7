"""The ``rollout`` section: how rollouts are produced or read, and the chosen source's own options
(its plug-in's section, `unirl.core.protocols.source_plugin`)."""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs

from unirl.core.config.sections.rollout_shaping import DynamicSamplingConfig, OverlongConfig
from unirl.core.config.validators import (
    finite,
    in_range,
    non_negative,
    positive,
)
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES


def _registered_source(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    SOURCES.get(value)


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        positive(instance, attribute, value)


def _optional_finite(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        finite(instance, attribute, value)


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How rollouts are produced or read. The temperature is also the one the trainer divides
    logits by, so train and rollout log-probs describe the same distribution. ``source`` names a
    registered `SourcePlugin`; that source's own section (the key inside ``rollout`` is its name,
    e.g. ``vllm: {kv_cache_gb: 1}``) is ``source_options``, an instance of the plug-in's options
    class (its defaults when the section is absent; None for a source without options)."""

    source: str = attrs.field(default="sampler", validator=_registered_source)
    file: str | None = None
    # The weight sync's bucket size in MiB: the most any rank holds beyond its own shards while
    # the policy's weights stream to a source that needs them (unirl.core.weights.stream).
    weight_bucket_mb: int = attrs.field(default=1024, validator=positive)
    # After every weight sync the receiver (each vLLM engine, the sampler's model) fingerprints
    # the weights it holds and the trainer compares them with what it sent: a sync that landed
    # partly stops the run naming the layer (unirl/core/weights/fingerprint.py). Here, not in a
    # source's section: it is the contract of every source that receives weights.
    verify_sync: bool = True
    task: str = "reverse_digits"
    # Keyword arguments of the task's factory, e.g. {min_digits: 2, max_digits: 3}.
    task_options: dict[str, Any] = attrs.field(factory=dict)
    temperature: float = attrs.field(default=1.0, validator=positive)
    top_p: float = attrs.field(default=1.0, validator=in_range(0, 1, low_open=True))
    max_new_tokens: int = attrs.field(default=64, validator=positive)
    # A JSONL prompt file used instead of rollout.task, scored by rollout.reward (a registered
    # name or "package.module:function") with rollout.reward_options as keyword arguments
    # (unirl/rollouts/data/prompts.py, unirl/rollouts/rewards/registry.py).
    prompts: str | None = None
    reward: str | None = None
    reward_options: dict[str, Any] = attrs.field(factory=dict)
    # rollout.reward in this many worker processes, one sample per call (0: in the training
    # process), each sample within reward_timeout_s seconds (None: no limit); a sample that
    # times out, crashes its worker or raises gets reward_on_error, or stops the run with an
    # error naming it ("raise"). unirl/rollouts/rewards/workers.py.
    reward_workers: int = attrs.field(default=0, validator=non_negative)
    reward_timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    reward_on_error: Literal["raise"] | float = "raise"
    # Drop prompts longer than model.max_seq_len - max_new_tokens (with a warning) instead of
    # refusing the file.
    skip_long_prompts: bool = False
    # The column mapping of rollout.prompts (JSONL, Parquet or a datasets folder;
    # unirl/rollouts/data/prompt_datasets.py): the column holding the prompt (text, or a list of
    # {role, content} chat messages), the one copied into metadata["answer"], and further
    # columns copied into the metadata under their own names.
    prompt_key: str = "prompt"
    answer_key: str | None = None
    metadata_keys: tuple[str, ...] = ()
    # Text prompts go through the tokenizer's chat template as one user message (a messages
    # prompt always does); system_prompt is put first in every chat prompt (unirl/rollouts/data/chat.py).
    apply_chat_template: bool = False
    system_prompt: str | None = None
    # Generation also ends after a response whose text contains one of these strings, or at one
    # of these token ids (besides the tokenizer's eos); the stop is the last response token.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Multi-turn episodes (unirl/rollouts/environments/episodes.py): an environment answers every policy turn
    # (a registered name or "package.module:Class", built with environment_options); at most
    # max_turns policy turns and max_episode_tokens response tokens (turns and observations;
    # None: up to model.max_seq_len); one environment call may take env_step_timeout_s seconds
    # (None: no limit); an environment that fails ends its episode with env_failure_reward
    # (None: the run stops with an error naming the episode and turn).
    environment: str | None = None
    environment_options: dict[str, Any] = attrs.field(factory=dict)
    max_turns: int = attrs.field(default=4, validator=positive)
    max_episode_tokens: int | None = attrs.field(default=None, validator=_optional_positive)
    env_step_timeout_s: float | None = attrs.field(default=60.0, validator=_optional_positive)
    env_failure_reward: float | None = attrs.field(default=None, validator=_optional_finite)
    # DAPO's data-side shaping (unirl/core/config/sections/rollout_shaping.py): groups with equal
    # rewards dropped and more prompts drawn; the soft overlong punishment added to the reward.
    dynamic_sampling: DynamicSamplingConfig = attrs.field(factory=DynamicSamplingConfig)
    overlong: OverlongConfig = attrs.field(factory=OverlongConfig)
    source_options: Any = None

    def __attrs_post_init__(self) -> None:
        _check_reward_run(self)
        _check_overlong(self)
        options_cls = SOURCES.get(self.source).options
        if options_cls is None:
            if self.source_options is not None:
                raise ConfigError(
                    f"rollout.source_options={self.source_options!r}: rollout source "
                    f"{self.source} has no options; leave it out"
                )
        elif self.source_options is None:
            object.__setattr__(self, "source_options", options_cls())
        elif not isinstance(self.source_options, options_cls):
            raise ConfigError(
                f"rollout.source_options={self.source_options!r} is not the rollout.{self.source} "
                f"section; pass a {options_cls.__name__} (or a 'rollout: {{{self.source}: ...}}' "
                "mapping in the YAML)"
            )


def _check_reward_run(r: RolloutConfig) -> None:
    """reward_timeout_s and reward_on_error act in the reward workers only."""
    if isinstance(r.reward_on_error, float) and not math.isfinite(r.reward_on_error):
        raise ConfigError(
            f"rollout.reward_on_error={r.reward_on_error!r}; give a finite reward or 'raise'"
        )
    if r.reward_workers == 0:
        for key, value, default in (
            ("reward_timeout_s", r.reward_timeout_s, None),
            ("reward_on_error", r.reward_on_error, "raise"),
        ):
            if value != default:
                raise ConfigError(
                    f"rollout.{key}={value!r} applies to rewards run in worker processes, but "
                    "rollout.reward_workers is 0 (the reward runs in the training process, which "
                    "cannot stop it); set rollout.reward_workers: 1 or more, or remove the key"
                )


def _check_overlong(r: RolloutConfig) -> None:
    """The overlong buffer lies inside the generation budget: a response's
    (``rollout.max_new_tokens``), or an episode's (``rollout.max_episode_tokens``, turns and
    observations together) under ``rollout.environment``."""
    buffer = r.overlong.buffer_tokens
    if buffer and r.environment is not None:
        if r.max_episode_tokens is not None and buffer > r.max_episode_tokens:
            raise ConfigError(
                f"rollout.overlong.buffer_tokens={buffer} is longer than "
                f"rollout.max_episode_tokens={r.max_episode_tokens} (an episode's penalty ramps "
                "over the last buffer_tokens of its budget); set it to "
                f"{r.max_episode_tokens} or less"
            )
        return
    if buffer > r.max_new_tokens:
        raise ConfigError(
            f"rollout.overlong.buffer_tokens={buffer} is longer than rollout.max_new_tokens="
            f"{r.max_new_tokens} (the penalty ramps over the last buffer_tokens of the budget); "
            f"set it to {r.max_new_tokens} or less"
        )
