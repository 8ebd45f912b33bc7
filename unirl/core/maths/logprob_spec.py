"""What a log-prob computation needs besides the logits: `LogprobSpec`, given to
`unirl.core.backend.token_logprobs` (and its fused-head twin) by the RL step for each forward."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class LogprobSpec:
    """How logits become log-probs: the sampling temperature (train and rollout log-probs must
    describe the same distribution), the true vocabulary (Megatron pads it), and whether entropy
    (and its gradient) is needed."""

    temperature: float = 1.0
    vocab_size: int | None = None
    with_entropy: bool = False
    entropy_grad: bool = False
