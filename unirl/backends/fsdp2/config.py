"""The ``fsdp2`` config section: how the FSDP2 backend shards, offloads and splits sequences.

Each option is a choice torch's `fully_shard` offers, named for what it does:

- ``sharding``: ``full_shard`` (ZeRO-3: parameters resharded after every forward, gathered again
  for the backward), ``shard_grad_op`` (ZeRO-2-like: parameters stay gathered between forward and
  backward, more memory, one all-gather less), ``hybrid`` (HSDP: shard within groups of
  ``shard_size`` ranks, replicate across the groups; gradients all-reduced over the replicas).
- ``cpu_offload``: parameters, gradients and optimizer state live in CPU memory (FSDP2's
  `CPUOffloadPolicy`); each layer is copied to the device when gathered.
- ``sp``: Ulysses sequence parallel degree. Sequences are split over ``sp`` ranks with core's
  context-parallel layout; attention exchanges heads for tokens with an all-to-all, so every rank
  attends over whole sequences for ``heads / sp`` heads.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from unirl.core.errors import ConfigError

Sharding = Literal["full_shard", "shard_grad_op", "hybrid"]


def _positive(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"fsdp2.{attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class Fsdp2Config:
    sharding: Sharding = "full_shard"
    # hybrid only: ranks per shard group (the rest of the world replicates); None = ranks per node
    shard_size: int | None = attrs.field(default=None, validator=_positive)
    cpu_offload: bool = False
    sp: int = attrs.field(default=1, validator=_positive)

    def check(self, world_size: int) -> None:
        """Combination checks against the world size (raised at setup, naming the key)."""
        if world_size % self.sp:
            raise ConfigError(
                f"fsdp2.sp={self.sp} does not divide the {world_size} ranks; launch a multiple "
                f"of {self.sp} processes or change fsdp2.sp"
            )
        if self.sharding != "hybrid" and self.shard_size is not None:
            raise ConfigError(
                f"fsdp2.shard_size={self.shard_size} is only used with fsdp2.sharding: hybrid "
                f"(got {self.sharding!r}); remove it or set sharding: hybrid"
            )
        if (
            self.sharding == "hybrid"
            and self.shard_size is not None
            and (world_size % self.shard_size or self.shard_size % self.sp)
        ):
            raise ConfigError(
                f"fsdp2.shard_size={self.shard_size} must divide the world size {world_size} "
                f"and be a multiple of fsdp2.sp={self.sp}"
            )
