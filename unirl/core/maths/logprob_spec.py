"""What a log-prob computation needs besides the logits: `LogprobSpec`, given to
`unirl.core.backend.token_logprobs` (and its fused-head twin) by the RL step for each forward."""

from __future__ import annotations

from typing import Literal

import attrs

# How the policy's MoE routers run in a pass, decided once by core from
# ``algorithm.routing_replay`` (`unirl.core.config.derived.routing_replay`):
# ``off`` route freely; ``record`` the forward-only pass records each token's experts (R2);
# ``replay`` a microbatch that carries ``routed_experts`` has them replayed, and the pass
# reports ``router/disagreement`` (R3 in every policy pass, R2 in the training passes).
RoutingReplay = Literal["off", "record", "replay"]


@attrs.frozen(kw_only=True)
class LogprobSpec:
    """How logits become log-probs: the sampling temperature (train and rollout log-probs must
    describe the same distribution), the true vocabulary (Megatron pads it), whether entropy
    (and its gradient) is needed, and whether a fused head may take the training loss into its
    token chunks (``loss_in_head``: ``model.fused_head`` with a loss separable over tokens, as
    `unirl.core.maths.head_loss.choose_head_path` decides; then a backend calls
    `unirl.core.backend.token_loss_from_hidden`). ``routing`` is the pass's routing replay
    (`RoutingReplay`): a backend reads it here, never from the config, as it reads
    ``loss_in_head``."""

    temperature: float = 1.0
    vocab_size: int | None = None
    with_entropy: bool = False
    entropy_grad: bool = False
    loss_in_head: bool = False
    routing: RoutingReplay = "off"
    # the token ids were checked against the vocabulary on the host (the RL step validates its
    # rollout batch first): the logits path leaves out its per-call device check, a host sync
    # each (the fused head's hidden-state path still makes it)
    targets_checked: bool = False
