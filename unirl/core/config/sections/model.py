"""The ``model`` section: which policy model, its dtype and length, the reference model."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from unirl.core.config.sections.lora import LoraConfig
from unirl.core.config.validators import (
    check_hf_config_shape,
    positive,
)
from unirl.core.errors import ConfigError

Dtype = Literal["fp32", "bf16"]


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The policy model: a local Hugging Face folder, or a HF config dict with a seed (random init)."""

    path: str | None = None
    hf_config: dict[str, Any] | None = attrs.field(default=None, validator=check_hf_config_shape)
    init_seed: int = 0
    dtype: Dtype = "fp32"
    gradient_checkpointing: bool = False
    # With gradient_checkpointing: whether the checkpointed layers run their attention again in
    # backward (true) or keep its output and recompute only the rest (false; dense models, not
    # under DeepSpeed ZeRO-3; `unirl.backends.kept_attention`): at 64k tokens attention is ~70%
    # of a 4B model's FLOPs; kept, it costs query heads x (head_dim x 2 + 4) bytes per token per
    # layer in bf16 (`unirl.core.config.recompute_plan`; unirl check prints the figure).
    recompute_attention: bool = True
    # Log-probs straight from the final hidden states and the LM head's weight, in token chunks
    # (`unirl.core.maths.head_loss`, `logprobs_hidden`): the [tokens, vocab] logits and their
    # gradient are never held (4.6 GiB each in bf16 at 16k tokens x 152k vocabulary). Below a few
    # GiB the plain head is faster (benchmarks/fused_head.py), so auto fuses exactly when the
    # plain head's logits + gradient per rank for the largest microbatch would exceed
    # fused_head_logits_gib (`unirl.core.config.head_memory`; `unirl check` prints the choice);
    # true / false force it.
    fused_head: bool | Literal["auto"] = "auto"
    # fused_head: auto's budget in GiB for the plain head's logits + gradient per rank. 10 keeps
    # 16k-token microbatches at a 152k vocabulary in bf16 (9.3 GiB) on the plain head.
    fused_head_logits_gib: float = attrs.field(default=10.0, validator=positive)
    # Liger's Triton kernels for RMSNorm, rotary embedding and SwiGLU in every decoder layer, on
    # the Hugging Face backends (DeepSpeed, FSDP2) on a GPU (`unirl.backends.hf.liger`); the
    # Megatron backend has its own fused layers and refuses it.
    liger_kernels: bool = False
    max_seq_len: int = attrs.field(default=2048, validator=positive)
    # A local Hugging Face tokenizer folder for rollout.prompts text (and saved with the export);
    # None: model.path's tokenizer, else a character tokenizer over the prompt file.
    tokenizer: str | None = None
    # The reference model for KL; defaults to the initial policy weights.
    ref_path: str | None = None
    ref_offload: bool = False
    # Train a low-rank adapter instead of the weights (`unirl.core.config.sections.lora`);
    # null: full fine-tuning.
    lora: LoraConfig | None = None

    def __attrs_post_init__(self) -> None:
        # One model, one source: the Hugging Face backends would load the folder while the
        # Megatron rules and the sampler's vocabulary read hf_config.
        if self.path is not None and self.hf_config is not None:
            raise ConfigError(
                f"model.path={self.path!r} and model.hf_config are both set; give one: the "
                "folder's weights and config.json, or hf_config with model.init_seed (random "
                "weights). To run an example on a folder: --set model.path=DIR --set "
                "model.hf_config=null"
            )
