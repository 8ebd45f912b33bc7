"""PPO's critic in the RL step: values for GAE, then the critic's own optimizer steps on the
returns (Schulman et al. 2017, with the value loss of `unirl.core.maths.losses.critic`).

    values   = critic.forward_values(this rank's share)          (forward-only, summed over dp)
    A, R     = gae(rewards shaped by KL / distillation, values)  (core, `compute_advantages`)
    policy   : optimizer steps on A                              (skipped while warming up)
    critic   : optimizer steps on R, clipped around the pre-step values

The critic runs its own microbatch plan (``critic.micro_batch_size``, else the policy's) with the
same optimizer steps and epochs as the policy. Its metrics are ``critic/*``: the value loss and
clip fraction over its training steps, and, from the pre-step values of the whole rollout, the
explained variance ``1 - Var(R - V) / Var(R)`` over valid response tokens (1: the critic
predicts the returns; 0: no better than their mean; < 0: worse).
"""

from __future__ import annotations

import torch

from unirl.core.config.run_config import UnirlConfig, critic_enabled

# Keeps the explained variance finite when every return is equal (as verl does).
_EV_EPS = 1e-8


def critic_warming_up(cfg: UnirlConfig, rl_step: int) -> bool:
    """Whether RL step ``rl_step`` (0-based) trains only the critic (``critic.warmup_steps``)."""
    return rl_step < cfg.critic.warmup_steps


def critic_optimizer_steps(cfg: UnirlConfig, policy_optimizer_steps: int) -> int:
    """The critic's optimizer steps in a run whose policy takes ``policy_optimizer_steps`` (what
    a backend is built with): the critic also trains in its warm-up RL steps."""
    return policy_optimizer_steps + cfg.critic.warmup_steps * cfg.layout.optimizer_steps_per_rollout


def value_metrics(
    values_bl: torch.Tensor, returns_bl: torch.Tensor, mask_bl: torch.Tensor
) -> dict[str, float]:
    """Pre-step statistics of the critic over the valid response tokens of the whole rollout."""
    mask = mask_bl.bool()
    v = values_bl[mask].double()
    r = returns_bl[mask].double()
    if v.numel() == 0:
        return {}
    var_r = r.var(unbiased=False)
    return {
        "critic/values_mean": float(v.mean()),
        "critic/returns_mean": float(r.mean()),
        "critic/explained_variance": float(1 - (r - v).var(unbiased=False) / (var_r + _EV_EPS)),
        "critic/values_abs_error": float((r - v).abs().mean()),
    }


def critic_summary(cfg: UnirlConfig) -> str:
    """Whether a critic trains, and from what weights, in one line."""
    c, estimator = cfg.critic, cfg.algorithm.advantage_estimator
    if not critic_enabled(cfg):
        why = "critic.enabled: false" if c.enabled is False else f"estimator {estimator!r}"
        return f"off ({why}{'; values from the rollout' if estimator == 'gae' else ''})"
    init = (
        f"critic.path={c.path!r}" if c.path else "the policy's initial weights + a new value head"
    )
    stage = cfg.parallel.zero_stage if c.zero_stage is None else c.zero_stage
    return (
        f"on (estimator {estimator!r}): {init}; lr {c.optimizer.lr} ({c.optimizer.lr_schedule}), "
        f"zero_stage {stage}, micro_batch_size "
        f"{c.micro_batch_size or 'as the policy'}, warm-up {c.warmup_steps} RL steps"
    )
