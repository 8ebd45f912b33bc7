"""The importance ratio and PPO's clipped surrogate, shared by the ratio-based policy losses."""

from __future__ import annotations

import torch

# exp(20) ~ 5e8: beyond this a ratio carries no information, only overflow risk (the gradient
# through the clamp is 0 there, which every clipped objective gives such tokens anyway).
LOG_RATIO_LIMIT = 20.0


def ratio_from_log(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(log_ratio)`` with the log-ratio clamped to ``[-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT]``."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic per-token loss and where the clipped branch was taken.

    ``loss_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` (the negated
    ``min(r A, clip(r) A)`` of Schulman et al. 2017). ``clipped_t`` is True where the clipped
    term is strictly larger, i.e. where the gradient is cut off.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped
