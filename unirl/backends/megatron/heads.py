"""What a model's last stage computes per microbatch, for the loss or the forward-only result: the
one thing that differs between the policy (or reference) and the critic.

- `LogprobHead`: per-token log-probs and entropy of the targets (core's `token_logprobs` on the
  vocabulary-parallel logits, or `token_logprobs_from_hidden` on the final hidden states and this
  rank's shard of the output weight with ``model.fused_head``); core's `LossFn` takes them.
- `ValueOutput`: the per-token values of a critic, whose output layer is a `ValueHead`
  (``Linear(hidden, 1)``); core's `ValueLossFn` takes them.

A head returns a tuple; its first entry is what a forward-only pass keeps, and the whole tuple
follows the microbatch into the loss function (`Head.loss`). With ``model.fused_head`` and a loss
separable over tokens (``spec.loss_in_head``, decided by core) the `LogprobHead` instead hands the
loss to core's `token_loss_from_hidden`, which computes it inside the head's token chunks (three
head matmuls instead of four).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import Tensor

from unirl.backends.megatron.fused_head import head_weight
from unirl.backends.megatron.schedule import ScheduledMicrobatch
from unirl.core.backend import (
    LogprobSpec,
    token_logprobs,
    token_logprobs_from_hidden,
    token_loss_from_hidden,
)
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses import Metric

Chunks = Sequence[torch.nn.Module]  # this rank's unwrapped chunks of the model that ran
Spec = LogprobSpec | None  # how logits become log-probs (None for a value head)
# loss_fn(microbatch, *head results) -> (loss, metrics): core's `LossFn` or `ValueLossFn`
HeadLossFn = Callable[..., tuple[Tensor, Mapping[str, Metric]]]


def _loss_after(  # the loss after the head: core's loss function on the head's results
    head: Head,
    chunks: Chunks,
    item: ScheduledMicrobatch,
    output: Tensor,
    spec: Spec,
    loss_fn: HeadLossFn,
) -> tuple[Tensor, Mapping[str, Metric]]:
    assert item.mb is not None
    return loss_fn(item.mb, *head(chunks, item, output, spec))


class Head(Protocol):
    def __call__(
        self, chunks: Chunks, item: ScheduledMicrobatch, output: Tensor, spec: Spec
    ) -> tuple[Tensor | None, ...]:
        """The microbatch's per-token results from the last stage's ``output``."""
        ...

    def loss(
        self,
        chunks: Chunks,
        item: ScheduledMicrobatch,
        output: Tensor,
        spec: Spec,
        loss_fn: HeadLossFn,
    ) -> tuple[Tensor, Mapping[str, Metric]]:
        """The microbatch's (unscaled) loss and metrics from the last stage's ``output``."""
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

    def loss(
        self,
        chunks: Chunks,
        item: ScheduledMicrobatch,
        output: Tensor,
        spec: Spec,
        loss_fn: HeadLossFn,
    ) -> tuple[Tensor, Mapping[str, Metric]]:
        """``loss_fn`` of the head's log-probs; inside the fused head when the spec allows it.
        Either way ``loss_fn`` sees this forward's own log-probs (what ``reuse`` detaches)."""
        assert item.mb is not None and spec is not None
        if not (self.fused and spec.loss_in_head):
            return _loss_after(self, chunks, item, output, spec, loss_fn)
        mb: TrainMicrobatch = item.mb
        out = token_loss_from_hidden(
            item.batch.real_logits(output),
            head_weight(chunks[-1]),
            mb,
            spec,
            loss_fn,
            tp_group=self.tp_group,
        )
        return out.loss, out.metrics


@attrs.frozen
class ValueOutput:
    """A critic's values: ``(values [T] fp32,)`` from its `ValueHead`'s ``[.., 1]`` output."""

    def __call__(
        self, chunks: Chunks, item: ScheduledMicrobatch, output: Tensor, spec: Spec
    ) -> tuple[Tensor]:
        return (item.batch.real_logits(output)[:, 0].float(),)  # [T, 1] -> [T]

    def loss(
        self,
        chunks: Chunks,
        item: ScheduledMicrobatch,
        output: Tensor,
        spec: Spec,
        loss_fn: HeadLossFn,
    ) -> tuple[Tensor, Mapping[str, Metric]]:
        return _loss_after(self, chunks, item, output, spec, loss_fn)


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
