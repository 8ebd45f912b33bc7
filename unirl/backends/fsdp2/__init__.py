"""FSDP2 backend: Hugging Face causal LMs sharded with PyTorch's `fully_shard` per decoder layer,
mixed precision, optional CPU offload, Ulysses sequence parallel, DCP checkpoints, on the shared
`unirl.backends.hf` loop and backend. Imported only when `backend: fsdp2` is chosen; ``plugin``
(its config section and rules) imports no engine."""

from __future__ import annotations

from unirl.backends.fsdp2.plugin import PLUGIN

build_backend = PLUGIN.build

__all__ = ["build_backend"]
