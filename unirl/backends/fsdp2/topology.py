"""The FSDP2 backend's device mesh and its core `Topology`.

Ranks are laid out ``(dp, sp)`` with sp fastest, which is Megatron's order with Ulysses sequence
parallel in the place of context parallel: core sees SP as CP (``cp_size = sp``), so the
microbatch split, the per-sequence all-reduces of the loss and the gather of forward-only
log-probs are core's context-parallel helpers, unchanged.

Parameters are sharded over every rank (the ``dp x sp`` world): the SP ranks of one group hold
the same weights, so sharding over them too saves memory at no extra communication per step.
Under ``sharding: hybrid`` the mesh is ``(replicate, shard)`` over the same ranks.
"""

from __future__ import annotations

import os

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unirl.backends.fsdp2.plugin import Fsdp2Options
from unirl.core.topology import ProcessGroups, Topology


@attrs.frozen(kw_only=True)
class Fsdp2Mesh:
    topology: Topology
    shard_mesh: DeviceMesh  # what fully_shard takes: 1-D (shard) or 2-D (replicate, shard)


def build_mesh(fsdp: Fsdp2Options, rank: int, world_size: int, device: torch.device) -> Fsdp2Mesh:
    fsdp.check_world(world_size)
    sp, dp = fsdp.sp, world_size // fsdp.sp
    mesh = init_device_mesh(device.type, (dp, sp), mesh_dim_names=("dp", "sp"))
    if fsdp.sharding == "hybrid":
        shard = fsdp.shard_size or _ranks_per_node(world_size)
        shard_mesh = init_device_mesh(
            device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    else:
        shard_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    groups = ProcessGroups(
        dp=mesh.get_group("dp") if dp > 1 else None,
        dp_cp=dist.group.WORLD if world_size > 1 else None,
        cp=mesh.get_group("sp") if sp > 1 else None,
    )
    topology = Topology.from_rank(rank, world_size, cp=sp, groups=groups)
    return Fsdp2Mesh(topology=topology, shard_mesh=shard_mesh)


def _ranks_per_node(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
