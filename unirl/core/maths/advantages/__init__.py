"""Advantage estimators: one rollout's rewards (and optional critic values, log-probs) to
per-token advantages ``[B, L]``, computed once per rollout before the optimizer steps.

    from unirl.core.maths.advantages import AdvantageInputs, AdvantageSettings, compute_advantages

    out = compute_advantages(
        AdvantageInputs(rewards=r, group_ids=g, response_mask=m),
        AdvantageSettings(estimator="grpo"),
        group=topology.groups.dp,  # only batch whitening communicates
    )

Built in: ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, ``gae``;
add one with `register_advantage_estimator` or name ``"package.module:function"``.
"""

from unirl.core.maths.advantages.compute import compute_advantages
from unirl.core.maths.advantages.gae import gae
from unirl.core.maths.advantages.grpo import dr_grpo, grpo
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.output import AdvantageOutput
from unirl.core.maths.advantages.registry import (
    AdvantageEstimator,
    EstimatorSpec,
    estimator_needs_old_logprobs,
    estimator_needs_values,
    get_advantage_estimator,
    register_advantage_estimator,
    registered_advantage_estimators,
)
from unirl.core.maths.advantages.reinforce_pp import reinforce_pp, reinforce_pp_baseline
from unirl.core.maths.advantages.rloo import rloo
from unirl.core.maths.advantages.settings import AdvantageSettings
from unirl.core.maths.advantages.shaping import apply_distillation, apply_kl_in_reward
from unirl.core.maths.advantages.token_rewards import rewards_for_estimator
from unirl.core.maths.advantages.whitening import masked_whiten

__all__ = [
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageOutput",
    "AdvantageSettings",
    "EstimatorSpec",
    "apply_distillation",
    "apply_kl_in_reward",
    "compute_advantages",
    "dr_grpo",
    "estimator_needs_old_logprobs",
    "estimator_needs_values",
    "gae",
    "get_advantage_estimator",
    "grpo",
    "masked_whiten",
    "register_advantage_estimator",
    "registered_advantage_estimators",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "rewards_for_estimator",
    "rloo",
]
