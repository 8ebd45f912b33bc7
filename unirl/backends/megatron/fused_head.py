"""``model.fused_head`` on Megatron: the last stage's output layer hands back its input (the
final hidden states) instead of the vocabulary-parallel logits, and the schedule's loss function
gives those and the output layer's weight shard (the word embedding's, when tied) to core's
`token_logprobs_from_hidden`.

megatron-core's `GPTModel` then returns the hidden states where it returned logits (batch-first
``[B, S, H]``), so the packed / padded batches pick the real tokens' rows exactly as they pick
logits rows. The hidden states are the same on every tensor-parallel rank (under
``parallel.sequence_parallel`` the layer first gathers the sequence, as its matmul would:
`sequence_parallel.gather_hidden`); the column-parallel layer's backward all-reduce of their
gradient is done by core (`unirl.core.maths.logprobs_hidden`, `unirl.core.maths.head_loss`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear

from unirl.backends.megatron.compat.sequence_parallel import gather_hidden


class HiddenOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer, its matmul left to core: returns ``(input, None)``."""

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, **_: Any
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            input_ = gather_hidden(input_)
        return input_, None


def emit_hidden(chunks: list[torch.nn.Module]) -> None:
    """Make the chunk that holds the output layer (the last stage's last virtual stage) return
    hidden states; parameters and state-dict keys are unchanged."""
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer.__class__ = HiddenOutputLayer


def head_weight(chunk: Any) -> torch.Tensor:
    """The weight the output layer would have used: this rank's ``[V_padded / tp, H]`` shard."""
    if chunk.share_embeddings_and_output_weights:
        return chunk.shared_embedding_or_output_weight()
    return chunk.output_layer.weight
