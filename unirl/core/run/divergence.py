"""Stop a run whose numbers stopped being finite, before it saves or exports them.

A non-finite loss or gradient makes the backend skip the optimizer step (the weights stay as
they were). One skip is a glitch; many in a row mean the run diverged (too high a learning rate,
a broken reward) and it only burns compute, so after ``train.max_consecutive_skipped_steps``
skipped optimizer steps in a row the run stops with `RunError`. Weights that are themselves no
longer finite (an infinite learning rate, an overflow in the update) stop the run at once: such
a policy is never checkpointed, synced to the rollout engine's next rollout or exported.

    guard = DivergenceGuard(max_consecutive_skips=3)
    guard.after_step(rl_step, metrics, backend.non_finite_weight())   # RunError: step and fix
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from unirl.core.errors import RunError

FIX = "lower optimizer.lr, keep optimizer.grad_clip set, or check the rewards"


class DivergenceGuard:
    def __init__(self, max_consecutive_skips: int) -> None:
        """`max_consecutive_skips` = 0 never stops for skipped steps (weights are still
        checked)."""
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0

    def after_step(
        self,
        rl_step: int,
        metrics: Mapping[str, object],
        non_finite_weight: str | None,
    ) -> None:
        """Call after RL step `rl_step` (counted from 1) with its metrics (``skipped_steps``:
        the fraction of its optimizer steps that were skipped; ``optimizer_steps``) and the
        first policy weight that is not finite (None: all are; the backend's
        ``non_finite_weight``, or the parameter a weight stream refused)."""
        bad = non_finite_weight
        if bad is not None:
            raise RunError(
                f"the policy weights are not finite after RL step {rl_step} (first in {bad}; "
                f"grad_norm {metrics.get('grad_norm')}, lr {metrics.get('lr')}); nothing of this "
                f"step was checkpointed or exported; {FIX}, then start again or --resume from "
                "the newest checkpoint"
            )
        skipped = float(metrics.get("skipped_steps", 0.0))  # type: ignore[arg-type]
        steps = int(float(metrics.get("optimizer_steps", 1.0)))  # type: ignore[arg-type]
        if math.isclose(skipped, 1.0):
            self.consecutive_skips += steps
        else:
            self.consecutive_skips = 0
        if self.max_consecutive_skips and self.consecutive_skips >= self.max_consecutive_skips:
            raise RunError(
                f"{self.consecutive_skips} optimizer steps in a row were skipped for a "
                f"non-finite loss or gradient (up to RL step {rl_step}; "
                f"train.max_consecutive_skipped_steps={self.max_consecutive_skips}): the run "
                f"diverged; {FIX}, then --resume from the newest checkpoint, or raise the limit "
                "(0 = never stop)"
            )
