"""Whether the policy's optimizer state lives in host memory (``optimizer.offload``), decided from
the model's shape and the GPU's memory.

Full fine-tuning in bf16 keeps, per parameter, bf16 weights, fp32 gradients, fp32 master weights
and two fp32 Adam moments: about 18 bytes, 67 GiB for Qwen3-4B before any activation, more than
an 80 GB H100 has left for a 64k-token sequence. Offloading the master weights and moments to
the host (and the Adam step with them) leaves the weights and gradients on the GPU, at the cost
of a device-to-host copy of the gradients and a host-to-device copy of the weights per optimizer
step and the Adam step on the CPU. So ``optimizer.offload: auto`` (the default) offloads only
when the state would not fit:

    params    = the model's matmul weights and embeddings, counted from its Hugging Face config
                (norms and biases, under 0.1%, left out; `unirl.core.config.param_count`): the
                dense part divided by parallel.tp x parallel.pp, a mixture-of-experts model's
                routed experts by parallel.ep x parallel.etp x parallel.pp
    resident  = each part x the backend's bytes per parameter on one GPU (its plug-in's
                `OptimizerOffload.gpu_bytes`, `expert_gpu_bytes` for the experts: weights,
                gradients, master weights, moments, divided by its sharding over data-parallel
                ranks, expert data-parallel ranks for the experts)
    offload   = resident > optimizer.offload_state_fraction x GPU memory

the GPU memory being ``optimizer.offload_gpu_gib`` or the first visible GPU's. ``cpu`` / ``none``
force it. The choice is made once from the config (and the visible GPU), so ``unirl check`` on
the training host prints the one the run takes; under LoRA the optimizer holds only the adapter
and is not offloaded by auto. A mixture-of-experts family the count does not know leaves the
size unknown: auto keeps the state on the GPU and says so. A backend option that offloads by
itself (``fsdp2.cpu_offload: true``: its plug-in's `OptimizerOffload.forced`) decides auto
before any of these: the state is in host memory whatever the plan says, and the report must
say where it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from unirl.core.config.model_shape import hf_config_fields
from unirl.core.config.param_count import (
    ParamCount,
    counted_moe_types,
    moe_keys,
    param_count,
)
from unirl.core.protocols.backend_plugin import BACKENDS, OptimizerOffload

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

GIB = 1 << 30


@attrs.frozen
class OffloadChoice:
    """Whether the policy's optimizer state is offloaded, and why (`unirl check`'s "optimizer
    state")."""

    offload: bool
    reason: str


def gpu_memory_gib(cfg: UnirlConfig) -> tuple[float | None, str]:
    """``optimizer.offload_gpu_gib``, else the first visible GPU's memory; None without one."""
    if cfg.optimizer.offload_gpu_gib is not None:
        return cfg.optimizer.offload_gpu_gib, "optimizer.offload_gpu_gib"
    import torch

    if not torch.cuda.is_available():
        return None, "no GPU visible"
    props = torch.cuda.get_device_properties(0)
    return props.total_memory / GIB, f"GPU 0 ({props.name})"


def choose_optimizer_offload(cfg: UnirlConfig) -> OffloadChoice:
    """``optimizer.offload`` resolved (module docstring)."""
    mode = cfg.optimizer.offload
    support = BACKENDS.get(cfg.backend).optimizer_offload
    if mode == "none":
        return OffloadChoice(False, "optimizer.offload: none: the optimizer state on the GPU")
    if mode == "cpu":
        assert support is not None  # the config refused it at load (run_config._check_offload)
        return OffloadChoice(True, f"optimizer.offload: cpu: {support.how}")
    auto = "optimizer.offload: auto"
    forced = support.forced(cfg) if support is not None else None
    if forced is not None:  # a backend option offloads by itself (fsdp2.cpu_offload)
        return OffloadChoice(True, f"{auto}, {forced}: offloaded: {support.how}")
    if cfg.model.lora is not None:
        return OffloadChoice(False, f"{auto}, model.lora: the optimizer holds only the adapter")
    if support is None:
        return OffloadChoice(False, f"{auto}, backend {cfg.backend} cannot offload: on the GPU")
    why = support.refuses(cfg)
    if why is not None:
        return OffloadChoice(False, f"{auto}, not offloadable here ({why}): on the GPU")
    hf = hf_config_fields(cfg.model) or {}
    count = param_count(hf)
    if count is None:
        return OffloadChoice(
            False, f"{auto}, the model's size is unknown{_uncounted(hf)}: on the GPU"
        )
    gib, source = gpu_memory_gib(cfg)
    if gib is None:
        return OffloadChoice(
            False,
            f"{auto}, {source} (set optimizer.offload_gpu_gib to plan for one): on the GPU",
        )
    return _plan(cfg, support, count, gib, source)


def _uncounted(hf: Mapping[str, Any]) -> str:
    """Why a config's size is unknown, when it is a mixture-of-experts family not counted."""
    keys = moe_keys(hf)
    if not keys:
        return ""
    return (
        f" (a mixture-of-experts config, model_type {hf.get('model_type')!r} with {keys}: "
        f"experts are counted for {counted_moe_types()} only; set optimizer.offload: cpu or "
        "none)"
    )


def _plan(
    cfg: UnirlConfig, support: OptimizerOffload, count: ParamCount, gib: float, source: str
) -> OffloadChoice:
    """The memory plan of ``auto`` (module docstring)."""
    p = cfg.parallel
    dense = count.dense / (p.tp * p.pp)
    expert = count.expert / (p.ep * (p.etp or p.tp) * p.pp)
    expert_bytes = support.expert_gpu_bytes or support.gpu_bytes

    def per_gpu(offloaded: bool) -> float:
        return (
            dense * support.gpu_bytes(cfg, offloaded) + expert * expert_bytes(cfg, offloaded)
        ) / GIB

    resident, offloaded = per_gpu(False), per_gpu(True)
    budget = cfg.optimizer.offload_state_fraction * gib
    offload = resident > budget
    experts = f" ({expert / 1e9:.2f}B of them experts)" if count.expert else ""
    shape = (
        f"{count.total / 1e9:.2f}B parameters, {(dense + expert) / 1e9:.2f}B per GPU{experts}: "
        f"weights + gradients + optimizer state {resident:.1f} GiB per GPU ({offloaded:.1f} "
        f"GiB offloaded), {'above' if offload else 'within'} optimizer.offload_state_fraction="
        f"{cfg.optimizer.offload_state_fraction:g} of {gib:.1f} GiB ({source})"
    )
    verdict = f"offloaded: {support.how}" if offload else "on the GPU"
    return OffloadChoice(offload, f"optimizer.offload: auto, {shape}: {verdict}")
