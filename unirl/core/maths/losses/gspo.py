"""GSPO: Group Sequence Policy Optimization (Zheng et al., Qwen team, 2025).

PPO's clipped surrogate on a SEQUENCE-level ratio, the geometric mean of the token ratios over
the sequence's valid tokens (length-normalised, so long and short responses clip alike)::

    s_i = exp( (1/|y_i|) sum_t (logp_t - old_logp_t) )

In its token-level form (GSPO-token), each token carries the value of ``s_i`` with the gradient
of its own log-prob::

    s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))
    loss_t = max(-A_t s_i,t, -A_t clip(s_i,t, 1 - clip_low, 1 + clip_high))

With ``A_t = A_i`` and ``seq-mean-token-mean`` aggregation (the paper's objective) the gradient
is exactly GSPO's: ``s_i A_i (1/|y_i|) sum_t grad logp_t``. The paper's clip ranges are tiny
(clip_low 3e-4, clip_high 4e-4). ``|y_i|`` is the sequence's GLOBAL valid-token count and the
sum runs over the CP group, so context parallel gives the same ratio as one rank.

Not separable over tokens: each token's gradient carries ``s_i``, made of the other log-probs of
its sequence, so the fused head keeps its four-matmul path for it (`unirl.core.maths.head_loss`).
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.aggregation import token_mean_metric
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.ratio import clipped_surrogate, ratio_from_log
from unirl.core.maths.losses.registry import register_policy_loss
from unirl.core.maths.losses.sequence import sequence_mean
from unirl.core.maths.losses.settings import LossSettings


@register_policy_loss("gspo", needs_old_logprobs=False, separable=False)
def gspo_loss(
    inp: LossInputs, counts: GlobalCounts, settings: LossSettings
) -> tuple[torch.Tensor, dict[str, Metric]]:
    """Per-token GSPO-token loss (see the module docstring)."""
    logp = inp.logprobs
    # sg(s_i): computed from detached values, so the CP sum needs no backward communication.
    seq_log_ratio = sequence_mean(
        (logp - inp.resolved_old_logprobs()).detach(),
        inp.mask,
        inp.seq_ids,
        inp.seq_token_counts,
        inp.cp_group,
    )
    log_ratio_t = seq_log_ratio[inp.seq_ids] + (logp - logp.detach())
    ratio = ratio_from_log(log_ratio_t)
    loss_t, clipped = clipped_surrogate(
        ratio, inp.advantages, settings.clip_low, settings.clip_high
    )
    return loss_t, {"pg_clipfrac": token_mean_metric(clipped, inp.mask)}
