"""What a model's last stage computes per microbatch, for the loss or the forward-only result: the
one thing that differs between the policy (or reference) and the critic.

- `LogprobHead`: per-token log-probs and entropy of the targets (core's `token_logprobs` on the
  vocabulary-parallel logits, or `token_logprobs_from_hidden` on the final hidden states and this
  rank's shard of the output weight with ``model.fused_head``); core's `LossFn` takes them.
- `ValueOutput`: the per-token values of a critic, whose output layer is a `ValueHead`
  (``Linear(hidden, 1)``); core's `ValueLossFn` takes them.

A head returns a tuple; its first entry is what a forward-only pass keeps, and the whole tuple
follows the microbatch into the loss function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import Tensor

from unirl.backends.megatron.fused_head import head_weight
from unirl.backends.megatron.schedule import ScheduledMicrobatch
from unirl.core.backend import LogprobSpec, token_logprobs, token_logprobs_from_hidden

Chunks = Sequence[torch.nn.Module]  # this rank's unwrapped chunks of the model that ran
Spec = LogprobSpec | None  # how logits become log-probs (None for a value head)


class Head(Protocol):
    def __call__(
        self, chunks: Chunks, item: ScheduledMicrobatch, output: Tensor, spec: Spec
    ) -> tuple[Tensor | None, ...]:
        """The microbatch's per-token results from the last stage's ``output``."""
        ...


@attrs.frozen(kw_only=True)
class LogprobHead:
    """The LM head of a policy or reference: ``(log-probs [T], entropy [T] or None)``."""

    fused: bool  # model.fused_head: `output` holds hidden states, not logits
    tp_group: Any  # the tensor-parallel group (None at tp = 1)

    def __call__(
        self, chunks: Chunks, item: ScheduledMicrobatch, output: Tensor, spec: Spec
    ) -> tuple[Tensor, Tensor | None]:
        assert item.mb is not None and spec is not None
        rows = item.batch.real_logits(output)  # [T, V_local] logits or [T, H] hidden states
        if self.fused:
            weight = head_weight(chunks[-1])
            return token_logprobs_from_hidden(
                rows, weight, item.mb.targets, spec, tp_group=self.tp_group
            )
        return token_logprobs(rows, item.mb.targets, spec, tp_group=self.tp_group)


@attrs.frozen
class ValueOutput:
    """A critic's values: ``(values [T] fp32,)`` from its `ValueHead`'s ``[.., 1]`` output."""

    def __call__(
        self, chunks: Chunks, item: ScheduledMicrobatch, output: Tensor, spec: Spec
    ) -> tuple[Tensor]:
        return (item.batch.real_logits(output)[:, 0].float(),)  # [T, 1] -> [T]


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel's output layer: ``[s, b, h] -> ([s, b, 1], None)``; megatron passes
    the (untied) output weight and gather flag, which a value head does not use.

    The head is whole on every tensor-parallel rank: the hidden states reaching it are whole there
    (no sequence parallel), so each rank computes the same values and the same head gradient, and
    megatron's gradient norm counts the head once (its parameters carry no
    ``tensor_model_parallel`` mark)."""

    is_value_head = True  # `convert` maps its weight and bias to HF's ``score``

    def __init__(self, hidden: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        # megatron's checkpointing reads output_layer.weight by that name
        self.weight = torch.nn.Parameter(torch.empty(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype, device=device))

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def install_value_head(chunks: Sequence[torch.nn.Module], hidden: int, dtype: torch.dtype) -> None:
    """Replace the output layer of the chunk that holds it (the last stage's last virtual stage)
    by a `ValueHead`, before the weights are loaded into it."""
    for chunk in chunks:
        if chunk.post_process:
            device = next(chunk.parameters()).device
            chunk.output_layer = ValueHead(hidden, dtype=dtype, device=device)
