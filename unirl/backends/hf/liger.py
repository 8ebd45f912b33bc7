"""``model.liger_kernels``: Liger's Triton kernels for the decoder layers of a Hugging Face model
(RMSNorm, rotary embedding, SwiGLU MLP) on the Hugging Face engines (DeepSpeed, FSDP2).

Why Liger and not our own: these are the memory-bound elementwise parts of a layer that eager
transformers runs as several kernels each (RMSNorm's fp32 upcast, power, mean, rsqrt and two
products; rotary's ``rotate_half`` concatenations; SwiGLU's activation and product), and Liger is
the kernel library the RL frameworks already use for them (TRL's ``use_liger_kernel``, verl's
``use_liger``). Its RMSNorm uses transformers' casting ("llama" mode) so the numbers follow the
eager model to bf16 rounding. Only these three: the head stays unirl's (logits + log-prob kernel,
or ``model.fused_head``), the loss stays core's.

Liger patches the model instance and, for the rotary embedding, the module function of the model
type in transformers (every model of that type in the process then uses it; the reference and
the policy run the same kernels). Triton needs a CUDA GPU; anywhere else the key is refused.
"""

from __future__ import annotations

from typing import Any

from unirl.core.errors import ConfigError

# model types whose Liger patch touches only the three kernels above (MoE blocks are unirl's:
# router capture and replay hook into them)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def apply_liger_kernels(model: Any, device_type: str) -> None:
    """Patch ``model`` (a transformers causal LM or token classifier) with Liger's RMSNorm,
    rotary and SwiGLU kernels, or refuse saying what to change."""
    model_type = getattr(model.config, "model_type", None)
    if device_type != "cuda":
        raise ConfigError(
            "model.liger_kernels: true needs a CUDA GPU (Liger's kernels are Triton); this rank "
            f"trains on {device_type!r}: set model.liger_kernels: false"
        )
    if model_type not in SUPPORTED:
        raise ConfigError(
            f"model.liger_kernels: true supports model types {', '.join(SUPPORTED)}; this model "
            f"is {model_type!r}: set model.liger_kernels: false"
        )
    # Liger's SwiGLU MLP is SiLU without biases whatever the config says
    act = getattr(model.config, "hidden_act", "silu")
    if act not in ("silu", "swish") or getattr(model.config, "mlp_bias", False):
        raise ConfigError(
            f"model.liger_kernels: true replaces the MLP with Liger's SwiGLU (SiLU, no bias); "
            f"this model has hidden_act={act!r}, mlp_bias="
            f"{getattr(model.config, 'mlp_bias', False)}: set model.liger_kernels: false"
        )
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:
        raise ConfigError(
            f"model.liger_kernels: true needs the liger-kernel package ({err}): "
            "pip install 'liger-kernel>=0.8.5', or set model.liger_kernels: false"
        ) from None
    _apply_liger_kernel_to_instance(
        model=model,
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
    )
