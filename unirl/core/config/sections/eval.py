"""The ``eval`` section: held-out prompts run through the rollout engine every ``every`` RL steps
and at the end, scored and logged as ``eval/*`` metrics (`unirl.rollouts.eval.evaluator`). Absent: no
evaluation."""

from __future__ import annotations

from typing import Any

import attrs

from unirl.core.config.validators import finite, non_negative, positive


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        positive(instance, attribute, value)


@attrs.frozen(kw_only=True)
class EvalConfig:
    """``prompts``: a prompt dataset in the format of ``rollout.prompts`` (JSONL, Parquet or a
    ``datasets`` folder, read through the same column mapping and chat template), every prompt
    of it evaluated each time. ``samples_per_prompt`` responses per prompt (k of pass@k);
    ``temperature`` and ``max_new_tokens`` None: the rollout's; ``reward`` None: the rollout's
    (``reward_options`` then the rollout's too). A sample passes when its reward is at least
    ``pass_threshold`` (1.0: a right answer of the built-in rewards). The other ranks wait for
    the evaluation (which runs on global rank 0) at most ``timeout_s`` seconds."""

    prompts: str
    # Every this many RL steps (0: only after the last step); always after the last step.
    every: int = attrs.field(default=0, validator=non_negative)
    samples_per_prompt: int = attrs.field(default=1, validator=positive)
    temperature: float | None = attrs.field(default=None, validator=_optional_positive)
    max_new_tokens: int | None = attrs.field(default=None, validator=_optional_positive)
    reward: str | None = None
    reward_options: dict[str, Any] = attrs.field(factory=dict)
    pass_threshold: float = attrs.field(default=1.0, validator=finite)
    # How long the other ranks wait for one evaluation on rank 0 (on a group of their own, not a
    # training collective, so parallel.timeout_s does not bound it).
    timeout_s: float = attrs.field(default=3600.0, validator=positive)
