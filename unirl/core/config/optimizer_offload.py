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
                (norms and biases, under 0.1%, left out), divided by parallel.tp x parallel.pp
    resident  = params x the backend's bytes per parameter on one GPU (its plug-in's
                `OptimizerOffload.gpu_bytes`: weights, gradients, master weights, moments,
                divided by its sharding over data-parallel ranks)
    offload   = resident > optimizer.offload_state_fraction x GPU memory

the GPU memory being ``optimizer.offload_gpu_gib`` or the first visible GPU's. ``cpu`` / ``none``
force it. The choice is made once from the config (and the visible GPU), so ``unirl check`` on
the training host prints the one the run takes; under LoRA the optimizer holds only the adapter
and is never offloaded by auto.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from unirl.core.config.model_shape import hf_config_fields
from unirl.core.protocols.backend_plugin import BACKENDS

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

GIB = 1 << 30


@attrs.frozen
class OffloadChoice:
    """Whether the policy's optimizer state is offloaded, and why (`unirl check`'s "optimizer
    state")."""

    offload: bool
    reason: str


def model_params(hf: Mapping[str, Any]) -> int | None:
    """Matmul weights and embeddings of a dense or mixture-of-experts decoder (Llama, Qwen2,
    Qwen3, Qwen3-MoE configs); None when the config lacks a size this needs."""
    try:
        h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
        heads = hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or h // heads
        if hf.get("num_experts"):
            experts = hf["num_experts"]
            mlp = experts * 3 * h * hf["moe_intermediate_size"] + h * experts  # + the router
        else:
            mlp = 3 * h * hf["intermediate_size"]
    except (KeyError, TypeError):
        return None
    attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim  # q, o; k, v
    embeddings = vocab * h * (1 if hf.get("tie_word_embeddings") else 2)
    return int(layers * (attention + mlp) + embeddings)


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
    if cfg.model.lora is not None:
        return OffloadChoice(False, f"{auto}, model.lora: the optimizer holds only the adapter")
    if support is None:
        return OffloadChoice(False, f"{auto}, backend {cfg.backend} cannot offload: on the GPU")
    why = support.refuses(cfg)
    if why is not None:
        return OffloadChoice(False, f"{auto}, not offloadable here ({why}): on the GPU")
    params = model_params(hf_config_fields(cfg.model) or {})
    if params is None:
        return OffloadChoice(False, f"{auto}, the model's size is unknown: on the GPU")
    gib, source = gpu_memory_gib(cfg)
    if gib is None:
        return OffloadChoice(
            False,
            f"{auto}, {source} (set optimizer.offload_gpu_gib to plan for one): on the GPU",
        )
    local = params / (cfg.parallel.tp * cfg.parallel.pp)
    resident = local * support.gpu_bytes(cfg, False) / GIB
    offloaded = local * support.gpu_bytes(cfg, True) / GIB
    budget = cfg.optimizer.offload_state_fraction * gib
    offload = resident > budget
    shape = (
        f"{params / 1e9:.2f}B parameters, {local / 1e9:.2f}B per GPU: weights + gradients + "
        f"optimizer state {resident:.1f} GiB per GPU ({offloaded:.1f} GiB offloaded), "
        f"{'above' if offload else 'within'} optimizer.offload_state_fraction="
        f"{cfg.optimizer.offload_state_fraction:g} of {gib:.1f} GiB ({source})"
    )
    verdict = f"offloaded: {support.how}" if offload else "on the GPU"
    return OffloadChoice(offload, f"{auto}, {shape}: {verdict}")
