"""The shared loss library: per-token tensors of one microbatch -> its share of the step loss.

Usage (once per microbatch, on every rank)::

    out = compute_loss(LossInputs(...), counts, settings)   # counts: GlobalCounts of the step
    out.loss.backward()                                      # after the backend's scale factor
    metrics_per_mb.append(out.metrics)
    ...
    logged = reduce_metrics(metrics_per_mb, group=topology.groups.dp_cp)   # once per step

Invariant: the sum of ``out.loss`` over every microbatch and every DP x CP rank is the objective
of the whole optimizer step, because every normaliser comes from `GlobalCounts` and the global
per-sequence token counts, never from the microbatch. Importing this package registers the
built-in policy losses (each module registers itself).
"""

from unirl.core.maths.losses.aggregation import (
    aggregate,
    aggregate_metric,
    global_normaliser,
    token_mean_metric,
    token_weights,
)
from unirl.core.maths.losses.cispo import cispo_loss
from unirl.core.maths.losses.critic import critic_loss
from unirl.core.maths.losses.gspo import gspo_loss
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric, reduce_metrics
from unirl.core.maths.losses.ppo_clip import ppo_clip_loss
from unirl.core.maths.losses.registry import (
    PolicyLossFn,
    get_policy_loss,
    policy_loss_is_separable,
    policy_loss_needs_old_logprobs,
    policy_loss_reads_behaviour,
    register_policy_loss,
    registered_policy_losses,
)
from unirl.core.maths.losses.reinforce import reinforce_loss
from unirl.core.maths.losses.rollout_correction import rollout_correction_weight
from unirl.core.maths.losses.separable import Separability, separability
from unirl.core.maths.losses.sequence import sequence_mean, sequence_sum
from unirl.core.maths.losses.settings import (
    AGGREGATION_MODES,
    ROLLOUT_CORRECTION_MODES,
    LossSettings,
)
from unirl.core.maths.losses.sft import sft_loss
from unirl.core.maths.losses.total import LossOutput, compute_loss
from unirl.core.maths.losses.value import value_loss

__all__ = [
    "AGGREGATION_MODES",
    "ROLLOUT_CORRECTION_MODES",
    "LossInputs",
    "LossOutput",
    "LossSettings",
    "Metric",
    "PolicyLossFn",
    "Separability",
    "aggregate",
    "aggregate_metric",
    "cispo_loss",
    "compute_loss",
    "critic_loss",
    "get_policy_loss",
    "global_normaliser",
    "gspo_loss",
    "policy_loss_is_separable",
    "policy_loss_needs_old_logprobs",
    "policy_loss_reads_behaviour",
    "ppo_clip_loss",
    "reduce_metrics",
    "register_policy_loss",
    "registered_policy_losses",
    "reinforce_loss",
    "rollout_correction_weight",
    "separability",
    "sequence_mean",
    "sequence_sum",
    "sft_loss",
    "token_mean_metric",
    "token_weights",
    "value_loss",
]
