"""Running one `TrainMicrobatch` on a backend's device: the move to the device, and the loss of a
microbatch without tokens."""

from __future__ import annotations

import attrs
import torch

from unirl.core.data.microbatch import TrainMicrobatch


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device`` without waiting for the GPU.

    A blocking copy to a CUDA device synchronises the stream (the host stops queueing work until
    the GPU has drained it), and a non-blocking one from pageable host memory may wait as well;
    from pinned memory it only queues the copy. So a host tensor is staged in pinned memory
    first: torch's caching host allocator keeps that block until the queued copy has run. A
    tensor that is pinned already is copied from its own memory: the caller must not change it
    until the copy has run (every caller here passes tensors it does not touch again)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_device(mb: TrainMicrobatch, device: torch.device) -> TrainMicrobatch:
    """``mb`` with every tensor field on ``device`` (non-blocking; the other fields as they are)."""
    moved = {
        f.name: to_device_async(getattr(mb, f.name), device)
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
