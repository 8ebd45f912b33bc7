"""The core `Topology` for DeepSpeed: ZeRO shards only along data parallel, so every rank is a
data-parallel rank (dp = world size; tp = pp = cp = 1)."""

from __future__ import annotations

import torch.distributed as dist

from unirl.core.topology import ProcessGroups, Topology


def deepspeed_topology(rank: int, world_size: int) -> Topology:
    """DeepSpeed's data-parallel group is the whole world; ``None`` groups for one process."""
    group = dist.group.WORLD if world_size > 1 else None
    return Topology(
        world_size=world_size,
        rank=rank,
        dp_size=world_size,
        dp_rank=rank,
        groups=ProcessGroups(dp=group, dp_cp=group),
    )
