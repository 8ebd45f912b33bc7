"""FSDP2 backend: Hugging Face causal LMs sharded with PyTorch's `fully_shard` per decoder layer,
mixed precision, optional CPU offload, Ulysses sequence parallel, DCP checkpoints. Imported only
when `backend: fsdp2` is chosen.

Files: `plugin` (the ``fsdp2:`` section, rules, constructor; imports no engine), `topology` (device
mesh), `engine` (sharding, mixed precision), `model` (`Fsdp2Model`, the policy and the critic;
the frozen reference), `packed` (the packed or Ulysses forward), `ulysses` (sequence-parallel
attention), `backend` (`Fsdp2Backend` on `unirl.backends.hf.backend.HFBackend`), `checkpoint`
(DCP files), `export` (gathering the shards).
"""

from __future__ import annotations

from unirl.backends.fsdp2.plugin import PLUGIN

build_backend = PLUGIN.build

__all__ = ["build_backend"]
