"""The data-side shaping a generating source applies (`GeneratingSource`): dynamic sampling
(`unirl.rollouts.shaping.dynamic_sampling`) and the overlong penalty (`unirl.rollouts.shaping.overlong`), as one
value built from the config, and what `unirl check` says about them and the truncation mask."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from unirl.core.config.sections.rollout_shaping import DynamicSamplingConfig, OverlongConfig
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES

if TYPE_CHECKING:  # the config and data modules import torch; `import unirl` must not
    from unirl.core.config.run_config import UnirlConfig
    from unirl.core.data.rollout import RolloutBatch


@attrs.frozen(kw_only=True)
class RolloutShaping:
    """What a generating source does to its rollouts beyond generating and scoring them."""

    dynamic_sampling: DynamicSamplingConfig = attrs.field(factory=DynamicSamplingConfig)
    overlong: OverlongConfig = attrs.field(factory=OverlongConfig)
    max_new_tokens: int = 0  # the overlong penalty's L_max (unused while it is off)

    @classmethod
    def from_config(cls, cfg: UnirlConfig) -> RolloutShaping:
        r = cfg.rollout
        return cls(
            dynamic_sampling=r.dynamic_sampling,
            overlong=r.overlong,
            max_new_tokens=r.max_new_tokens,
        )


def overlong_metrics(batch: RolloutBatch) -> dict[str, float]:
    """``reward/overlong_penalty`` (mean over the rollout's samples) and ``reward/task_mean``
    (the reward before it), from what `GeneratingSource.build_batch` wrote into the metadata."""
    penalties = [
        s.metadata["overlong_penalty"] for s in batch.samples if "overlong_penalty" in s.metadata
    ]
    if not penalties:
        return {}
    task = [s.metadata["task_reward"] for s in batch.samples if "task_reward" in s.metadata]
    return {
        "reward/overlong_penalty": sum(penalties) / len(penalties),
        "reward/task_mean": sum(task) / len(task),
    }


def check_dynamic_sampling(cfg: UnirlConfig) -> None:
    """Dynamic sampling draws more prompts: only a generating source can; its criterion is a
    registered name."""
    from unirl.rollouts.shaping.dynamic_sampling import GROUP_FILTERS

    ds = cfg.rollout.dynamic_sampling
    if not ds.enabled:
        return
    if not SOURCES.get(cfg.rollout.source).generates:
        raise ConfigError(
            f"rollout.dynamic_sampling.enabled=true draws more prompts, but rollout.source: "
            f"{cfg.rollout.source} reads finished rollouts; use a generating source or set "
            "rollout.dynamic_sampling.enabled: false"
        )
    if cfg.batch.samples_per_prompt < 2:
        raise ConfigError(
            "rollout.dynamic_sampling.enabled=true keeps groups whose rewards differ, but "
            f"batch.samples_per_prompt={cfg.batch.samples_per_prompt}; set it to 2 or more"
        )
    GROUP_FILTERS.get(ds.criterion)


def shaping_summary(cfg: UnirlConfig) -> dict[str, str]:
    """What the three DAPO data-side features do to the step, for `unirl check`."""
    r, b = cfg.rollout, cfg.batch
    ds, ol = r.dynamic_sampling, r.overlong
    if ds.enabled:
        exhausted = (
            "fills the rollout up with filtered groups whose loss mask is zero (no tokens)"
            if ds.on_exhausted == "train"
            else "stops the run with an error"
        )
        dyn = (
            f"on: keeps groups passing {ds.criterion!r}, drawing {b.prompts_per_rollout} prompts "
            f"at a time, up to {ds.max_draws} draws ({ds.max_draws * b.prompts_per_rollout} "
            f"prompts, {ds.max_draws * b.prompts_per_rollout * b.samples_per_prompt} samples "
            f"generated) per rollout; still short after that, it {exhausted}; the step always "
            f"trains {b.prompts_per_rollout} groups; eval is never filtered"
        )
    else:
        dyn = "off (every drawn group is trained on)"
    if ol.buffer_tokens and r.environment is not None:
        budget = r.max_episode_tokens or cfg.model.max_seq_len
        over = (
            f"on, per episode: reward += 0 up to {ol.buffer_tokens} tokens short of the "
            f"episode's budget ({budget} response tokens, turns and observations, within "
            f"model.max_seq_len), then linear to -{ol.penalty_factor:g} at it; logged as "
            "reward/overlong_penalty"
        )
    elif ol.buffer_tokens:
        start = r.max_new_tokens - ol.buffer_tokens
        over = (
            f"on: reward += 0 up to {start} response tokens, then linear to "
            f"-{ol.penalty_factor:g} at {r.max_new_tokens} (a response cut at the budget gets "
            f"-{ol.penalty_factor:g}); logged as reward/overlong_penalty"
        )
    else:
        over = "off"
    if cfg.algorithm.mask_truncated:
        trunc = (
            "on: a sample cut at rollout.max_new_tokens (an episode at its turn or token limit) "
            "trains no token and leaves the step's token and sequence counts; its reward still "
            "enters its group's baseline"
        )
    else:
        trunc = "off (cut samples train like finished ones)"
    return {"dynamic_sampling": dyn, "overlong_penalty": over, "mask_truncated": trunc}
