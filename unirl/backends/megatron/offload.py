"""What the Megatron backend keeps on a GPU per parameter, with its optimizer state offloaded or
not (``optimizer.offload``, `unirl.core.config.optimizer_offload`; the offload itself:
`unirl.backends.megatron.optimizer.offload_config`).

Per parameter of a rank's model chunks: the weights (bf16: 2 bytes, fp32: 4), the fp32
gradient buffer (4, ``grad_reduce_in_fp32``), and the optimizer's fp32 master weights (4 under
bf16; under fp32 the weights are their own master) and two Adam moments (8), divided over the
data-parallel ranks by the distributed optimizer (``parallel.zero_stage: 1``); a routed expert's
over the expert data-parallel ranks (``world / (ep x etp x pp)``: megatron builds a distributed
optimizer of their own). Offloaded, the master weights and moments leave the GPU; the offload
needs the distributed optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.protocols.backend_plugin import OptimizerOffload
from unirl.core.topology import expert_data_parallel_size

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig


def _bytes(cfg: UnirlConfig, offloaded: bool, dp: int) -> float:
    bf16 = cfg.model.dtype == "bf16"
    weights_and_grads = (2 if bf16 else 4) + 4
    if offloaded:
        return weights_and_grads
    state = (4 if bf16 else 0) + 8
    return weights_and_grads + state / (dp if cfg.parallel.zero_stage == 1 else 1)


def gpu_bytes(cfg: UnirlConfig, offloaded: bool) -> float:
    """Bytes per dense parameter on one GPU (module docstring)."""
    return _bytes(cfg, offloaded, cfg.layout.dp)


def expert_gpu_bytes(cfg: UnirlConfig, offloaded: bool) -> float:
    """Bytes per routed-expert parameter on one GPU (module docstring)."""
    p = cfg.parallel
    expert_dp = expert_data_parallel_size(
        cfg.layout.world_size, ep=p.ep, etp=p.etp or p.tp, pp=p.pp
    )
    return _bytes(cfg, offloaded, expert_dp)


def refuses(cfg: UnirlConfig) -> str | None:
    """Megatron offloads through its distributed optimizer only."""
    if cfg.parallel.zero_stage != 1:
        return (
            f"parallel.zero_stage={cfg.parallel.zero_stage}: megatron-core offloads the "
            "distributed optimizer's state (precision-aware); set parallel.zero_stage: 1"
        )
    return None


OFFLOAD = OptimizerOffload(
    how=(
        "megatron-core's HybridDeviceOptimizer: fp32 master weights and Adam moments in host "
        "memory, torch's fused AdamW steps them on the CPU; gradients to the host and weights "
        "back each step"
    ),
    gpu_bytes=gpu_bytes,
    expert_gpu_bytes=expert_gpu_bytes,
    refuses=refuses,
)
