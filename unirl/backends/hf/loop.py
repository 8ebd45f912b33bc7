"""The microbatch loop of the Hugging Face engines, written once: forward-only and training.

Per microbatch: to the device -> the model's forward -> the head turns its output into what the
loss reads (log-probs and entropy for the policy and the reference, values for the critic) ->
count the forward -> the core loss (or, with ``model.fused_head`` and a loss separable over
tokens, the loss the head computed inside the LM head's forward: `LogprobHead.loss_fn`) -> a zero through the graph for a microbatch without tokens ->
backward of ``loss x scale`` -> report and tick the progress bar. An engine supplies the model
(`PackedModel`, `TrainedPackedModel`: how to run a packed microbatch, where the accumulation
boundary falls, how to backward, its one loss-scale factor, its device); the head is
`LogprobHead` or `VALUE_HEAD`. Nothing here knows which engine runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import attrs
import torch

from unirl.backends.hf.fused_head import FusedLMHead, packed_logprobs, training_loss
from unirl.backends.microbatch import to_device, zero_through_graph
from unirl.core.backend import LossFn
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.logprob_spec import LogprobSpec
from unirl.core.maths.losses import Metric
from unirl.core.progress.bars import MicrobatchProgress


class PackedModel(Protocol):
    """A model that runs packed microbatches (a frozen one: the reference)."""

    device: torch.device

    def forward(self, mb: TrainMicrobatch) -> torch.Tensor:
        """The model's ``.logits[0]`` on ``mb`` (one pad token's row for an empty microbatch:
        every rank joins the engine's collectives)."""
        ...

    def forward_only(self) -> AbstractContextManager[None]:
        """Eval mode and no autograd (and, where the engine needs it, the weights moved in)."""
        ...


class TrainedPackedModel(PackedModel, Protocol):
    """A model with its own optimizer (the policy, the critic)."""

    def train(self) -> None: ...

    def loss_scale(self, num_microbatches: int) -> float:
        """The one factor that cancels the engine's averaging (`TrainingBackend.loss_scale`)."""
        ...

    def begin_microbatch(self, *, last: bool) -> None:
        """Before the forward: ``last`` marks the gradient-accumulation boundary."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...


@attrs.frozen
class HeadOutput:
    values: torch.Tensor  # [T]: log-probs or values, what a forward-only pass returns
    entropy: torch.Tensor | None  # [T] or None
    raw: torch.Tensor  # the model's output, for `zero_through_graph`
    # the loss and metrics when the head computed them (the loss inside the fused head)
    loss: torch.Tensor | None = None
    metrics: Mapping[str, Metric] | None = None


Head = Callable[[Callable[[TrainMicrobatch], torch.Tensor], TrainMicrobatch], HeadOutput]
# around(microbatch): a context entered around one microbatch's forward (and backward)
Around = Callable[[TrainMicrobatch], AbstractContextManager[None]]
# loss(microbatch, head output) -> (this microbatch's share of the objective, metrics)
HeadLoss = Callable[[TrainMicrobatch, HeadOutput], tuple[torch.Tensor, Mapping[str, Metric]]]


@attrs.frozen
class LogprobHead:
    """Per-token log-probs (and entropy) of a causal LM: from the logits, or from the fused
    head when the model has one (`packed_logprobs`). With ``loss_fn`` (a training pass whose
    loss core found separable, ``spec.loss_in_head``) the fused head computes the loss itself
    (`training_loss`: three head matmuls) for each microbatch with tokens."""

    fused: FusedLMHead | None
    spec: LogprobSpec
    loss_fn: LossFn | None = None

    @classmethod
    def for_training(
        cls, fused: FusedLMHead | None, spec: LogprobSpec, loss_fn: LossFn
    ) -> LogprobHead:
        """The training pass's head: the loss inside the fused head where core allows it."""
        return cls(fused, spec, loss_fn if fused is not None and spec.loss_in_head else None)

    def __call__(
        self, forward: Callable[[TrainMicrobatch], torch.Tensor], mb: TrainMicrobatch
    ) -> HeadOutput:
        if self.loss_fn is not None and self.fused is not None and mb.num_tokens > 0:
            res, out = training_loss(forward, self.fused, mb, self.spec, self.loss_fn)
            return HeadOutput(
                values=res.logprobs,
                entropy=res.entropy,
                raw=out,
                loss=res.loss,
                metrics=res.metrics,
            )
        logp, entropy, out = packed_logprobs(forward, self.fused, mb, self.spec)
        return HeadOutput(values=logp, entropy=entropy, raw=out)


def value_head(
    forward: Callable[[TrainMicrobatch], torch.Tensor], mb: TrainMicrobatch
) -> HeadOutput:
    """The critic's per-token values ``[T]`` fp32: column 0 of a one-label token classifier
    (``[T, 1]``); an empty microbatch's pad-token row is kept only for the zero loss."""
    out = forward(mb)
    values = out[:0, 0] if mb.num_tokens == 0 else out[:, 0]
    return HeadOutput(values=values.float(), entropy=None, raw=out)


def forward_only_pass(
    model: PackedModel,
    head: Head,
    microbatches: Sequence[TrainMicrobatch],
    *,
    progress: MicrobatchProgress,
    count: Callable[[], None],
    around: Around | None = None,
) -> list[torch.Tensor]:
    """Detached fp32 ``head`` values ``[T]`` per microbatch, on the device; ``count`` is called
    once per model forward; ``around(mb)`` is entered around each microbatch's forward (the
    policy's routing replay)."""
    out = []
    with model.forward_only():
        for mb in microbatches:
            mb = to_device(mb, model.device)
            with nullcontext() if around is None else around(mb):
                result = head(model.forward, mb)
            count()
            out.append(result.values.float())
            progress.report(tokens=mb.num_tokens)
            progress.tick()
    return out


def training_pass(
    model: TrainedPackedModel,
    head: Head,
    microbatches: Sequence[TrainMicrobatch],
    *,
    loss: HeadLoss,
    progress: MicrobatchProgress,
    count: Callable[[], None],
    around: Around | None = None,
    around_metrics: Callable[[TrainMicrobatch], Mapping[str, Metric]] | None = None,
) -> list[Mapping[str, Metric]]:
    """Accumulate the gradients of one optimizer step's microbatches; per-microbatch metrics.
    ``around(mb)`` is entered around each microbatch's forward and backward (a checkpointed layer
    recomputes its forward in backward: routing replay must still hold); ``around_metrics(mb)``
    adds what it measured to the microbatch's metrics."""
    model.train()
    metrics = []
    last = len(microbatches) - 1
    scale = model.loss_scale(len(microbatches))
    for i, mb in enumerate(microbatches):
        mb = to_device(mb, model.device)
        model.begin_microbatch(last=i == last)
        with nullcontext() if around is None else around(mb):
            result = head(model.forward, mb)
            count()
            if result.loss is not None and result.metrics is not None:
                mb_loss, mb_metrics = result.loss, result.metrics  # computed inside the head
            else:
                mb_loss, mb_metrics = loss(mb, result)
            if mb.num_tokens == 0:
                # this rank's backward must run the engine's collectives as the others' do
                mb_loss = mb_loss + zero_through_graph(result.raw)
            model.backward(mb_loss * scale)
        if around_metrics is not None:
            mb_metrics = {**mb_metrics, **around_metrics(mb)}
        metrics.append(mb_metrics)
        progress.report(loss=mb_loss.detach(), tokens=mb.num_tokens)
        progress.tick()
    return metrics
