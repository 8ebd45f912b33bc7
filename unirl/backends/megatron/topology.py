"""The core `Topology` filled from megatron-core's parallel state."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state as ps

from unirl.backends.process_group import collective_timeout
from unirl.core.config.run_config import ParallelConfig
from unirl.core.topology import ProcessGroups, Topology


def initialize_parallel_state(parallel: ParallelConfig) -> None:
    """Create Megatron's process groups from unirl's parallel config (dp is derived)."""
    if not ps.model_parallel_is_initialized():
        # megatron gives its groups their own timeout (30 minutes by default): use the run's
        # parallel.timeout_s so that a hung rank fails the job within that bound here too
        timeout = collective_timeout(parallel, dist.get_backend())
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.vpp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            distributed_timeout_minutes=timeout.total_seconds() / 60,
        )


# Backends built on the parallel state and not closed yet: `unirl serve` holds one backend per
# training client in one process, and closing one must not tear the groups down under another.
_holders = 0


def hold_parallel_state(parallel: ParallelConfig) -> None:
    """`initialize_parallel_state` for a backend, counted until it calls `release_parallel_state`."""
    global _holders
    initialize_parallel_state(parallel)
    _holders += 1


def release_parallel_state() -> None:
    """The last holder destroys megatron's parallel state (the groups, its globals)."""
    global _holders
    _holders = max(_holders - 1, 0)
    if _holders == 0:
        ps.destroy_model_parallel()


def topology_from_parallel_state() -> Topology:
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    return Topology(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        cp_size=ps.get_context_parallel_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        vpp_size=vpp if vpp and vpp > 1 else None,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
        edp_size=ps.get_expert_data_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        edp_rank=ps.get_expert_data_parallel_rank(),
        groups=ProcessGroups(
            dp=ps.get_data_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            cp=ps.get_context_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(),
            edp=ps.get_expert_data_parallel_group(),
        ),
    )
