"""FSDP2 backend: Hugging Face causal LMs sharded with PyTorch's `fully_shard` per decoder layer,
mixed precision, optional CPU offload, Ulysses sequence parallel, DCP checkpoints. Imported only
when `backend: fsdp2` is chosen.

Files: `plugin` (the ``fsdp2:`` section, rules, constructor; imports no engine), `topology` (device
mesh), `engine` (sharding, mixed precision, optimizer), `packed` (packed microbatches through
varlen attention), `ulysses` (sequence-parallel attention), `backend` (`Fsdp2Backend`),
`checkpoint`, `export`.
"""

from __future__ import annotations

from unirl.backends.fsdp2.plugin import PLUGIN

build_backend = PLUGIN.build

__all__ = ["build_backend"]
