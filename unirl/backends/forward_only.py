"""The forward-only pass of a policy or reference model: eval mode, no autograd, and an offloaded
reference moved onto the device for the pass and back after it. One sequence for every backend,
so that a model left in eval mode or on the wrong device after a pass cannot differ by engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def forward_only(
    modules: Sequence[torch.nn.Module], *, device: torch.device, offloaded: bool = False
) -> Iterator[None]:
    """Run the block with ``modules`` in eval mode under ``torch.no_grad``; ``offloaded``: they
    live on the CPU and are moved to ``device`` for the block. Their train mode is restored."""
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()
        if offloaded:
            m.to(device)
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in zip(modules, was_training):
            m.train(training)
            if offloaded:
                m.to("cpu")
