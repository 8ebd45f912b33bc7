"""PPO's clipped value loss (Schulman et al. 2017; the clipping follows OpenAI baselines' ppo2).

    v_clip_t = clip(v_t, old_v_t - c, old_v_t + c)
    loss_t = 0.5 * max((v_t - R_t)^2, (v_clip_t - R_t)^2)

The max keeps the pessimistic error, so a value prediction cannot jump far from its pre-step
value in one update. ``value_clip=None`` gives the plain ``0.5 (v - R)^2``; ``old_values=None``
means reuse (the pre-step values are this forward's own, so nothing is clipped).
"""

from __future__ import annotations

import torch


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor | None,
    value_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value loss and where the clipped error was the larger (``vf_clipfrac``)."""
    error = (values - returns).square()
    if value_clip is None:
        return 0.5 * error, torch.zeros_like(values, dtype=torch.bool)
    old = values.detach() if old_values is None else old_values
    # Clamped into [old - c, old + c] rather than old + clamp(values - old): inside the range
    # this is ``values`` to the bit, so a token counts as clipped only where the clip acts (the
    # other form flags float-rounding ties, and flags different ones on every backend).
    clipped_values = torch.clamp(values, old - value_clip, old + value_clip)
    clipped_error = (clipped_values - returns).square()
    return 0.5 * torch.maximum(error, clipped_error), clipped_error > error
