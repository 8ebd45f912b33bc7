"""The policy as a Hugging Face causal LM: loaded from a local folder, or built from a config dict
with a seeded random init (tests, demos, from-scratch runs). The DeepSpeed backend trains it; the
Megatron backend converts its weights, so one seed names the same weights on both backends.

Attention is PyTorch SDPA (``attn_implementation="sdpa"``): it runs on the CPU and on GPUs without
flash-attn. A bf16 model built from a config is the fp32 init rounded to bf16, so one seed names
one set of weights whatever the dtype.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from unirl.core.config.run_config import CriticConfig, ModelConfig
from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "sdpa"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(model_cfg: ModelConfig) -> torch.dtype:
    return _DTYPES[model_cfg.dtype]


def _check_folder(path: str, key: str) -> Path:
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        what = "does not exist" if not folder.exists() else "has no config.json"
        raise ConfigError(
            f"{key}={path!r} {what}; set {key} to a local Hugging Face model folder "
            "(the output of save_pretrained, with config.json and the weights), or use "
            "model.hf_config for a random init"
        )
    if (folder / "unirl_megatron.json").is_file():  # `unirl convert`'s Megatron weights folder
        raise ConfigError(
            f"{key}={path!r} is a Megatron weights folder (written by unirl convert), which only "
            "backend: megatron reads; convert it back with `unirl convert "
            f"{path} HF_DIR` and set {key} to HF_DIR"
        )
    return folder


def load_pretrained(path: str, dtype: torch.dtype, *, key: str = "model.path") -> Any:
    """`AutoModelForCausalLM.from_pretrained` from a local folder (nothing is downloaded)."""
    from transformers import AutoModelForCausalLM

    folder = _check_folder(path, key)
    return AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
    )


def build_from_config(hf_config: dict[str, Any], seed: int, dtype: torch.dtype) -> Any:
    """A randomly initialised model from a config dict; the same seed gives the same weights.

    The init draws from a forked torch RNG, so building a model does not move the caller's
    random stream (a resumed run must see the same stream as an uninterrupted one).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf_config)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            f"model.hf_config={hf_config!r} has no model_type; add one such as model_type: llama"
        )
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except ValueError as err:
        raise ConfigError(f"model.hf_config.model_type={model_type!r}: {err}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
        )
    return model.to(dtype)


def load_policy(model_cfg: ModelConfig) -> Any:
    """The policy at its initial weights, in the configured dtype, in train mode."""
    dtype = torch_dtype(model_cfg)
    if model_cfg.path is not None:
        model = load_pretrained(model_cfg.path, dtype)
    else:
        assert model_cfg.hf_config is not None  # the config checks one of the two is set
        model = build_from_config(model_cfg.hf_config, model_cfg.init_seed, dtype)
    model.config.use_cache = False  # training never decodes; the KV cache only costs memory
    if model_cfg.gradient_checkpointing:
        enable_checkpointing(model, model_cfg)
    model.train()
    return model


def enable_checkpointing(model: Any, model_cfg: ModelConfig) -> None:
    """transformers' per-layer activation checkpoint, non-reentrant (it works with ZeRO-3's
    parameter hooks and frozen inputs); under ``model.recompute_attention: false`` selective,
    keeping attention's outputs (`unirl.backends.kept_attention`), the cuDNN probe run from the
    embedding's output, before the first checkpointed layer."""
    from unirl.backends import kept_attention
    from unirl.backends.cudnn_attention import probe_ahead
    from unirl.core.config.model_shape import head_dim
    from unirl.core.config.recompute_rules import refuse_experts

    kwargs: dict[str, Any] = {"use_reentrant": False}
    if not model_cfg.recompute_attention:
        refuse_experts(model.config.to_dict())  # the loaded model's config, checked again
        kwargs["context_fn"] = kept_attention.contexts
        width = head_dim(model.config.to_dict())

        def probe(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
            if torch.is_grad_enabled():
                probe_ahead(out.device, out.dtype, width)

        model.get_input_embeddings().register_forward_hook(probe)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_reference(model_cfg: ModelConfig) -> Any:
    """The frozen reference for KL: ``model.ref_path`` if set, else the policy's initial weights
    (reloaded from ``model.path`` or rebuilt from the same seed, so it never sees training)."""
    dtype = torch_dtype(model_cfg)
    if model_cfg.ref_path is not None:
        model = load_pretrained(model_cfg.ref_path, dtype, key="model.ref_path")
    elif model_cfg.path is not None:
        model = load_pretrained(model_cfg.path, dtype)
    else:
        assert model_cfg.hf_config is not None
        model = build_from_config(model_cfg.hf_config, model_cfg.init_seed, dtype)
    model.config.use_cache = False
    model.requires_grad_(False)
    model.eval()
    return model


def _critic_config(config: Any) -> Any:
    """A copy of a model config set up for a value head: one label, no classifier dropout (the
    values must be deterministic in training, as the log-probs are), no KV cache."""
    import copy

    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.use_cache = False
    return config


def load_critic(model_cfg: ModelConfig, critic_cfg: CriticConfig) -> Any:
    """PPO's value model in Hugging Face layout: ``AutoModelForTokenClassification`` with one
    label (the causal LM's backbone + ``score``, a ``Linear(hidden, 1)`` per token), in train mode.

    From ``critic.path``: a saved critic loads whole; a causal LM gives its backbone and the head
    is initialised. Otherwise the backbone is the policy's initial weights (reloaded from
    ``model.path`` or rebuilt from ``model.hf_config`` + ``model.init_seed``). A new head is
    transformers' own init (normal, std ``initializer_range``; zero bias) drawn from a torch RNG
    seeded with ``model.init_seed`` (forked: the caller's stream does not move)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    dtype = torch_dtype(model_cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_cfg.init_seed)
        if critic_cfg.path is not None:
            folder = _check_folder(critic_cfg.path, "critic.path")
            config = _critic_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
            try:
                model = AutoModelForTokenClassification.from_pretrained(
                    str(folder),
                    config=config,
                    dtype=dtype,
                    attn_implementation=ATTN_IMPLEMENTATION,
                    local_files_only=True,
                )
            except ValueError as err:
                raise ConfigError(
                    f"critic.path={critic_cfg.path!r}: no value model: {err}"
                ) from None
        else:
            base = (
                load_pretrained(model_cfg.path, torch.float32)
                if model_cfg.path is not None
                else build_from_config(
                    model_cfg.hf_config or {}, model_cfg.init_seed, torch.float32
                )
            )
            torch.manual_seed(model_cfg.init_seed)  # the head's init: from this seed alone
            try:
                model = AutoModelForTokenClassification.from_config(
                    _critic_config(base.config),
                    dtype=torch.float32,
                    attn_implementation=ATTN_IMPLEMENTATION,
                )
            except ValueError as err:
                raise ConfigError(
                    f"critic: the policy's architecture {type(base).__name__} has no token-"
                    f"classification variant in transformers ({err}); give critic.path"
                ) from None
            backbone = getattr(model, model.base_model_prefix)
            backbone.load_state_dict(getattr(base, base.base_model_prefix).state_dict())
            model = model.to(dtype)
    model.config.architectures = [type(model).__name__]  # what an export's config names
    if model_cfg.gradient_checkpointing:
        enable_checkpointing(model, model_cfg)
    model.train()
    return model
