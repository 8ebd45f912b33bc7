"""What an advantage estimator returns."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(kw_only=True, eq=False)
class AdvantageOutput:
    """``advantages [B, L]`` for the policy loss and ``returns [B, L]`` (the critic's regression
    target for GAE; the Monte-Carlo return elsewhere). Both are zero outside the response mask."""

    advantages: torch.Tensor
    returns: torch.Tensor
