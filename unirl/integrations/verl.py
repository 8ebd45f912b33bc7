"""unirl's policy losses in verl's policy-loss registry, selected by a verl config.

Importing this module registers every unirl policy loss as ``unirl_<name>`` in
``verl.trainer.ppo.core_algos.POLICY_LOSS_REGISTRY``; verl imports it in each worker when named
as an external lib::

    actor_rollout_ref.model.external_lib=unirl.integrations.verl
    actor_rollout_ref.actor.policy_loss.loss_mode=unirl_gspo
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean

(or ``VERL_USE_EXTERNAL_MODULES=unirl.integrations.verl``). What is read from verl's actor config:

- ``clip_ratio_low`` / ``clip_ratio_high`` (each defaulting to ``clip_ratio``): unirl's
  ``clip_low`` / ``clip_high``. ``clip_ratio_c`` becomes ``dual_clip`` for ``unirl_ppo_clip``
  only: verl's vanilla loss ALWAYS dual-clips (c = 3 by default), unirl's ``ppo_clip`` only when
  asked, so the registered loss follows verl's config to give verl's numbers.
- ``loss_agg_mode`` maps one to one (``token-sum`` has no unirl counterpart and is refused).
  ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor``, and when that is unset by the
  padded response length L, as verl does (unirl's own trainer needs an explicit norm length).
- ``global_batch_info``: ``batch_num_tokens`` / ``global_batch_size`` are the step's counts and
  the loss is multiplied by ``dp_size`` (verl's FSDP / Megatron average over data-parallel ranks).
- ``rollout_is_weights`` (verl's rollout correction) weight the policy term; KL and entropy stay
  with verl's actor, which adds them outside the policy loss.

Needs ``verl`` (its ``core_algos`` module is plain PyTorch; ``pip install --no-deps verl`` plus
``tests/requirements-nodeps.txt`` is enough on the CPU). ``import unirl`` never imports this.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.losses import AGGREGATION_MODES, LossSettings, registered_policy_losses
from unirl.losses import policy_loss

logger = logging.getLogger(__name__)

PREFIX = "unirl_"
# The metrics every verl policy loss reports (verl's actor logs them).
_VERL_METRICS = ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def settings_from_verl(name: str, loss_agg_mode: str, config: Any) -> LossSettings:
    """unirl's `LossSettings` for the policy term, from verl's actor config (see the module doc)."""
    if loss_agg_mode not in AGGREGATION_MODES:
        raise ConfigError(
            f"actor.loss_agg_mode={loss_agg_mode!r} has no unirl counterpart; unirl losses take "
            f"one of {list(AGGREGATION_MODES)}"
        )
    clip = config.clip_ratio
    low = clip if config.clip_ratio_low is None else config.clip_ratio_low
    high = clip if config.clip_ratio_high is None else config.clip_ratio_high
    dual_clip = config.get("clip_ratio_c", 3.0) if name == "ppo_clip" else None
    return LossSettings(
        policy_loss=name,
        loss_aggregation=loss_agg_mode,
        clip_low=low,
        clip_high=high,
        dual_clip=dual_clip,
    )


def _global_counts(
    config: Any, response_mask: torch.Tensor
) -> tuple[int, int | None, int | None, int]:
    """``(dp_size, tokens, sequences, norm_length)`` from verl's ``global_batch_info``."""
    info = dict(config.get("global_batch_info", None) or {})
    dp_size = int(info.get("dp_size") or 1)
    tokens, sequences = info.get("batch_num_tokens"), info.get("global_batch_size")
    if dp_size > 1 and (tokens is None or sequences is None):
        raise LossInputError(
            f"verl's global_batch_info has dp_size={dp_size} but batch_num_tokens={tokens} / "
            f"global_batch_size={sequences}; a unirl loss needs the global counts under data "
            "parallel (verl's actor sets them)"
        )
    scale = info.get("loss_scale_factor", config.get("loss_scale_factor", None))
    norm_length = int(scale) if scale is not None else int(response_mask.shape[-1])
    return dp_size, tokens, sequences, norm_length


def make_verl_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """A function with verl's policy-loss signature that computes unirl's loss ``name``."""

    def verl_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if config is None:
            raise ConfigError(f"verl loss {PREFIX}{name}: config (verl's ActorConfig) is required")
        settings = settings_from_verl(name, loss_agg_mode, config)
        dp_size, tokens, sequences, norm_length = _global_counts(config, response_mask)
        loss, metrics = policy_loss(
            name,
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            settings=settings,
            global_tokens=tokens,
            global_sequences=sequences,
            norm_length=norm_length,
            is_weights=rollout_is_weights,
        )
        out = {f"actor/{k}": metrics.get(k, 0.0) for k in _VERL_METRICS}
        out.update({f"actor/unirl/{k}": v for k, v in metrics.items() if k not in _VERL_METRICS})
        # verl's engines average gradients over data-parallel ranks: multiply it back out.
        return loss * dp_size, out

    verl_policy_loss.__name__ = f"{PREFIX}{name}"
    verl_policy_loss.__qualname__ = f"{PREFIX}{name}"
    return verl_policy_loss


def register_verl_policy_losses(names: Iterable[str] | None = None) -> list[str]:
    """Register unirl's policy losses (default: every registered one) as ``unirl_<name>`` in
    verl's registry; returns the verl names. Calling it again re-registers (idempotent)."""
    from verl.trainer.ppo.core_algos import register_policy_loss

    registered = []
    for name in registered_policy_losses() if names is None else names:
        verl_name = f"{PREFIX}{name}"
        register_policy_loss(verl_name)(make_verl_policy_loss(name))
        registered.append(verl_name)
    logger.info("registered unirl policy losses in verl: %s", registered)
    return registered


VERL_LOSS_NAMES = register_verl_policy_losses()
