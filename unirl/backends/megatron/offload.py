"""What the Megatron backend keeps on a GPU per parameter, with its optimizer state offloaded or
not (``optimizer.offload``, `unirl.core.config.optimizer_offload`; the offload itself:
`unirl.backends.megatron.optimizer.offload_config`).

Per parameter of a rank's model chunks: the weights (bf16: 2 bytes, fp32: 4), the fp32
gradient buffer (4, ``grad_reduce_in_fp32``), and the optimizer's fp32 master weights (4 under
bf16; under fp32 the weights are their own master) and two Adam moments (8), divided over the
data-parallel ranks by the distributed optimizer (``parallel.zero_stage: 1``). Offloaded, the
master weights and moments leave the GPU; the offload needs the distributed optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.protocols.backend_plugin import OptimizerOffload

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig


def gpu_bytes(cfg: UnirlConfig, offloaded: bool) -> float:
    """Bytes per parameter on one GPU (module docstring)."""
    bf16 = cfg.model.dtype == "bf16"
    weights_and_grads = (2 if bf16 else 4) + 4
    if offloaded:
        return weights_and_grads
    state = (4 if bf16 else 0) + 8
    return weights_and_grads + state / (cfg.layout.dp if cfg.parallel.zero_stage == 1 else 1)


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
    refuses=refuses,
)
