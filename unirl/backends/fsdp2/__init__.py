"""FSDP2 backend: Hugging Face causal LMs sharded with PyTorch's `fully_shard` per decoder layer,
mixed precision, optional CPU offload, Ulysses sequence parallel, DCP checkpoints. Imported only
when `backend: fsdp2` is chosen.

Files: `config` (the ``fsdp2`` section), `distributed` (process group), `topology` (device mesh),
`engine` (sharding, mixed precision, optimizer), `packed` (packed microbatches through varlen
attention), `ulysses` (sequence parallel attention), `backend` (`Fsdp2Backend`), `checkpoint`,
`export`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unirl.backends.fsdp2.backend import Fsdp2Backend
    from unirl.core.run.config import UnirlConfig


def build_backend(cfg: UnirlConfig, **kwargs: Any) -> Fsdp2Backend:
    """`Fsdp2Backend(cfg, fsdp, total_optimizer_steps=..., needs_reference=...)`; the ``fsdp2``
    section defaults until the config carries it."""
    from unirl.backends.fsdp2.backend import Fsdp2Backend
    from unirl.backends.fsdp2.config import Fsdp2Config

    fsdp = kwargs.pop("fsdp", None) or Fsdp2Config()
    return Fsdp2Backend(cfg, fsdp, **kwargs)


__all__ = ["build_backend"]
