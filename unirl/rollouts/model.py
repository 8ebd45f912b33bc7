"""A Hugging Face model that fits a task's tokenizer: its config, and a seeded random init.

The built-in tasks use a 14-15 token vocabulary, so the model config of a demo run must have at
least that many embedding rows and agree with the tokenizer on the special ids. Build the policy
and the sampler from `hf_config_for_tokenizer` so both see the same vocabulary:

    hf = hf_config_for_tokenizer(cfg.model.hf_config, task.tokenizer)
    model = build_task_model(cfg.model, task.tokenizer)   # from hf (seeded) or model.path
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unirl.core.config.run_config import ModelConfig
from unirl.core.errors import ConfigError
from unirl.rollouts.data.tasks import TaskTokenizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_config_for_tokenizer(
    hf_config: Mapping[str, Any], tokenizer: TaskTokenizer
) -> dict[str, Any]:
    """``hf_config`` with ``vocab_size`` (when absent) and the special token ids filled in from
    ``tokenizer``. A larger ``vocab_size`` is kept (the extra ids are never right answers); a
    smaller one, or special ids that disagree, raise `ConfigError`."""
    config = dict(hf_config)
    vocab = config.setdefault("vocab_size", tokenizer.vocab_size)
    if not isinstance(vocab, int) or vocab < tokenizer.vocab_size:
        raise ConfigError(
            f"model.hf_config.vocab_size={vocab!r} is smaller than the task tokenizer's "
            f"vocabulary of {tokenizer.vocab_size} tokens; set it to {tokenizer.vocab_size} or "
            "more, or leave it out"
        )
    for key, value in tokenizer.special_token_ids().items():
        have = config.setdefault(key, value)
        if have != value:
            raise ConfigError(
                f"model.hf_config.{key}={have!r} but the task tokenizer uses id {value}; set it "
                f"to {value} or leave it out"
            )
    return config


def build_task_model(model_cfg: ModelConfig, tokenizer: TaskTokenizer) -> torch.nn.Module:
    """The model of ``model_cfg``: loaded from ``model.path`` (local files only), or randomly
    initialised from ``model.hf_config`` with ``model.init_seed`` (the global torch RNG is left
    as it was)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = _DTYPES[model_cfg.dtype]
    if model_cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.path, local_files_only=True)
        vocab = int(model.config.vocab_size)
        if vocab < tokenizer.vocab_size:
            raise ConfigError(
                f"model.path={model_cfg.path!r} has vocab_size {vocab}, smaller than the task "
                f"tokenizer's {tokenizer.vocab_size} tokens; use a model built for the task"
            )
        return model.to(dtype)
    if model_cfg.hf_config is None:
        raise ConfigError("model: set model.path or model.hf_config")
    data = hf_config_for_tokenizer(model_cfg.hf_config, tokenizer)
    model_type = data.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ConfigError(
            f"model.hf_config.model_type={model_type!r}; name a Hugging Face architecture "
            "such as llama or qwen2"
        )
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"model.hf_config.model_type={model_type!r}: {err}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_cfg.init_seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype)
