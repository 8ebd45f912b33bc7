"""Running one `TrainMicrobatch` on a backend's device: the move to the device, and the loss of a
microbatch without tokens."""

from __future__ import annotations

import attrs
import torch

from unirl.core.data.microbatch import TrainMicrobatch


def to_device(mb: TrainMicrobatch, device: torch.device) -> TrainMicrobatch:
    """``mb`` with every tensor field on ``device`` (non-blocking; the other fields as they are)."""
    moved = {
        f.name: getattr(mb, f.name).to(device, non_blocking=True)
        for f in attrs.fields(TrainMicrobatch)
        if isinstance(getattr(mb, f.name), torch.Tensor)
    }
    return mb.with_fields(**moved)


def zero_through_graph(logits: torch.Tensor) -> torch.Tensor:
    """A zero that reaches every parameter the logits depend on.

    A rank whose microbatch holds no tokens (or a pipeline's padding microbatch) must still run
    the backward as the other ranks do: ZeRO's per-parameter gradient hooks and the pipeline's
    gradient sends are collectives. Adding this to its (empty) loss keeps the value 0 and
    connects the graph."""
    return logits.sum() * 0.0
