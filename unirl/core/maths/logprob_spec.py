"""What a log-prob computation needs besides the logits: `LogprobSpec`, given to
`unirl.core.backend.token_logprobs` (and its fused-head twin) by the RL step for each forward."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class LogprobSpec:
    """How logits become log-probs: the sampling temperature (train and rollout log-probs must
    describe the same distribution), the true vocabulary (Megatron pads it), whether entropy
    (and its gradient) is needed, and whether a fused head may take the training loss into its
    token chunks (``loss_in_head``: ``model.fused_head`` with a loss separable over tokens, as
    `unirl.core.maths.head_loss.choose_head_path` decides; then a backend calls
    `unirl.core.backend.token_loss_from_hidden`)."""

    temperature: float = 1.0
    vocab_size: int | None = None
    with_entropy: bool = False
    entropy_grad: bool = False
    loss_in_head: bool = False
    # the token ids were checked against the vocabulary on the host (the RL step validates its
    # rollout batch first): the logits path leaves out its per-call device check, a host sync
    # each (the fused head's hidden-state path still makes it)
    targets_checked: bool = False
