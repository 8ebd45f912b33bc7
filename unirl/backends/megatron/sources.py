"""Where each model the Megatron backend holds gets its initial weights: an HF config and a local
folder or a state dict, converted into megatron's chunks by `convert`.

- policy: ``model.path``, or ``model.hf_config`` + ``init_seed`` built exactly as the DeepSpeed
  backend builds it (same seed -> same weights in both backends);
- reference: ``model.ref_path``, else the policy's initial weights (it never sees training);
- critic: Hugging Face's ``*ForTokenClassification`` with one label
  (`unirl.backends.hf_model.load_critic`, the DeepSpeed critic's exact initialisation), untied
  (its head is not the embedding); `convert` maps ``score`` <-> the `ValueHead`.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import torch

from unirl.backends.hf_model import build_from_config, load_critic
from unirl.backends.megatron.hf_io import read_hf_config
from unirl.core.run.config import UnirlConfig


@attrs.frozen(kw_only=True)
class ModelSource:
    """Where a model's initial weights come from: an HF config and a local folder or state dict."""

    hf_config: Any
    weights: Any  # str (local safetensors folder) or Mapping[str, Tensor]


def policy_source(cfg: UnirlConfig) -> ModelSource:
    if cfg.model.path is not None:
        return ModelSource(hf_config=read_hf_config(cfg.model.path), weights=cfg.model.path)
    assert cfg.model.hf_config is not None  # the config checks one of the two is set
    model = build_from_config(cfg.model.hf_config, cfg.model.init_seed, torch.float32)
    return ModelSource(hf_config=model.config, weights=model.state_dict())


def reference_source(cfg: UnirlConfig) -> ModelSource:
    if cfg.model.ref_path is not None:
        return ModelSource(
            hf_config=read_hf_config(cfg.model.ref_path, key="model.ref_path"),
            weights=cfg.model.ref_path,
        )
    return policy_source(cfg)


def critic_source(cfg: UnirlConfig) -> ModelSource:
    hf_model = load_critic(cfg.model, cfg.critic)
    config = copy.deepcopy(hf_model.config)
    config.tie_word_embeddings = False
    weights = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return ModelSource(hf_config=config, weights=weights)
