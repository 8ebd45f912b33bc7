"""DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): a GRPO group whose
samples all got the same reward has zero advantage everywhere and teaches nothing, so it is
dropped and more prompts are drawn until the rollout holds ``batch.prompts_per_rollout`` kept
groups, or ``rollout.dynamic_sampling.max_draws`` draws were made.

Which groups are kept is a registered function of the group's rewards (`GROUP_FILTERS`, chosen by
``rollout.dynamic_sampling.criterion``; ``varied_rewards`` is DAPO's rule). Kept groups past the
target are dropped (DAPO does the same). A rollout whose draws ran out is filled up with filtered
groups whose loss mask is zero (``on_exhausted: train``: the plan's fixed sample count holds and
they add no token to the loss or to the step's counts) or stops the run (``error``).

Every rank sees the same rewards (scored once and broadcast), so every rank draws as often and
keeps the same groups. Eval never goes through here (`GeneratingSource.generate_eval`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch

from unirl.core.config.sections.rollout_shaping import DynamicSamplingConfig
from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.errors import RunError
from unirl.core.registry import Registry, same_callable

GroupFilter = Callable[[Sequence[float]], bool]

GROUP_FILTERS: Registry[GroupFilter] = Registry(
    "dynamic-sampling criterion", key="rollout.dynamic_sampling.criterion", same=same_callable
)


def varied_rewards(rewards: Sequence[float]) -> bool:
    """DAPO's rule: keep a group unless all its rewards are equal (then every group-normalised
    advantage is zero)."""
    return max(rewards) != min(rewards)


def register_group_filter(name: str, fn: GroupFilter) -> GroupFilter:
    """Make ``fn(rewards) -> keep`` choosable as ``rollout.dynamic_sampling.criterion: name``."""
    return GROUP_FILTERS.register(name, fn)


register_group_filter("varied_rewards", varied_rewards)


def split_groups(batch: RolloutBatch) -> list[tuple[RolloutSample, ...]]:
    """The batch's groups in order (a group's samples are consecutive, as sources build them)."""
    groups: list[list[RolloutSample]] = []
    for s in batch.samples:
        if groups and groups[-1][0].group_id == s.group_id:
            groups[-1].append(s)
        else:
            groups.append([s])
    return [tuple(g) for g in groups]


def _masked(group: Sequence[RolloutSample]) -> tuple[RolloutSample, ...]:
    """A filtered group as padding: its loss mask zero, so no token of it reaches the loss (an
    episode's per-token rewards too: the rollout check refuses a reward on an untrained token)."""
    out = []
    for s in group:
        rewards = None if s.token_rewards is None else torch.zeros_like(s.token_rewards)
        out.append(
            attrs.evolve(
                s,
                loss_mask=torch.zeros_like(s.loss_mask),
                token_rewards=rewards,
                metadata=s.metadata | {"padding": True},
            )
        )
    return tuple(out)


@attrs.frozen(kw_only=True)
class DrawStats:
    """What dynamic sampling did for one rollout (logged under ``rollout/``)."""

    draws: int
    groups_drawn: int
    groups_kept: int  # passed the criterion (also those past the target, then dropped)
    padding_groups: int
    generation_s: float
    discarded_s: float  # generation seconds of groups not trained on, by their response tokens

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/draws": float(self.draws),
            "rollout/groups_drawn": float(self.groups_drawn),
            "rollout/groups_kept": float(self.groups_kept),
            "rollout/groups_kept_fraction": self.groups_kept / max(self.groups_drawn, 1),
            "rollout/padding_groups": float(self.padding_groups),
            "rollout/discarded_generation_s": self.discarded_s,
            "rollout/discarded_generation_fraction": self.discarded_s
            / max(self.generation_s, 1e-12),
        }


def collect(
    draw: Callable[[], RolloutBatch],
    *,
    config: DynamicSamplingConfig,
    groups_wanted: int,
    rl_step: int,
) -> tuple[RolloutBatch, DrawStats]:
    """Call ``draw`` (one rollout of new prompts) until ``groups_wanted`` groups passed the
    criterion or ``config.max_draws`` draws were made; the rollout of the first ``groups_wanted``
    kept groups (padded or refused per ``config.on_exhausted``) and what it cost."""
    keep = GROUP_FILTERS.get(config.criterion)
    kept: list[tuple[RolloutSample, ...]] = []
    filtered: list[tuple[RolloutSample, ...]] = []
    draws = drawn = passed = 0
    total_s = discarded_s = 0.0
    while draws < config.max_draws and len(kept) < groups_wanted:
        t0 = time.perf_counter()
        batch = draw()
        seconds = time.perf_counter() - t0
        draws += 1
        groups = split_groups(batch)
        drawn += len(groups)
        tokens = sum(s.response_length for s in batch.samples) or 1
        for group in groups:
            passes = keep([s.reward for s in group])
            passed += passes
            used = passes and len(kept) < groups_wanted
            (kept if used else filtered).append(group)
            if not used:  # filtered, or kept past the target
                discarded_s += seconds * sum(s.response_length for s in group) / tokens
        total_s += seconds
    missing = groups_wanted - len(kept)
    if missing and (config.on_exhausted == "error" or not kept):
        raise RunError(
            f"rollout {rl_step}: dynamic sampling kept {len(kept)} of {drawn} groups in "
            f"{draws} draws (criterion {config.criterion!r}), fewer than "
            f"batch.prompts_per_rollout={groups_wanted}; raise "
            f"rollout.dynamic_sampling.max_draws (now {config.max_draws}), use prompts that are "
            "neither always solved nor never"
            + (
                ", or set rollout.dynamic_sampling.on_exhausted: train"
                if kept
                else " (with no group kept there is nothing to train, also under on_exhausted: train)"
            )
        )
    # padding: the newest filtered groups, masked (their generation time stays discarded)
    padding = [_masked(g) for g in filtered[len(filtered) - missing :]] if missing else []
    samples = tuple(s for g in kept + padding for s in g)
    stats = DrawStats(
        draws=draws,
        groups_drawn=drawn,
        groups_kept=passed,
        padding_groups=len(padding),
        generation_s=total_s,
        discarded_s=discarded_s,
    )
    return RolloutBatch(samples), stats
