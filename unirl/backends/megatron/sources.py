"""Where each model the Megatron backend holds gets its initial weights: an HF config and a local
folder or a state dict, converted into megatron's chunks by `convert`.

- policy: ``model.path`` (a Hugging Face folder, or a Megatron weights folder written by
  ``unirl convert``: `weights_folder`), or ``model.hf_config`` + ``init_seed`` built exactly as the DeepSpeed
  backend builds it (same seed -> same weights in both backends);
- reference: ``model.ref_path``, else the policy's initial weights (it never sees training);
- critic: Hugging Face's ``*ForTokenClassification`` with one label
  (`unirl.backends.causal_lm.load_critic`, the DeepSpeed critic's exact initialisation), untied
  (its head is not the embedding); `convert` maps ``score`` <-> the `ValueHead`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import attrs
import torch

from unirl.backends.causal_lm import build_from_config, load_critic
from unirl.backends.megatron.weights.hf_io import read_hf_config
from unirl.backends.megatron.weights_folder import MegatronWeights, is_weights_folder
from unirl.core.config.run_config import UnirlConfig


@attrs.frozen(kw_only=True)
class ModelSource:
    """Where a model's initial weights come from: an HF config and a local folder or state dict."""

    hf_config: Any
    # str (local safetensors folder), Mapping[str, Tensor] or a Megatron weights folder
    weights: Any


def _folder_source(path: str, key: str) -> ModelSource:
    """A Hugging Face folder, or a Megatron weights folder of `unirl convert` (its shards)."""
    weights = MegatronWeights(Path(path).expanduser()) if is_weights_folder(path) else path
    return ModelSource(hf_config=read_hf_config(path, key=key), weights=weights)


def policy_source(cfg: UnirlConfig) -> ModelSource:
    if cfg.model.path is not None:
        return _folder_source(cfg.model.path, "model.path")
    assert cfg.model.hf_config is not None  # the config checks one of the two is set
    model = build_from_config(cfg.model.hf_config, cfg.model.init_seed, torch.float32)
    return ModelSource(hf_config=model.config, weights=model.state_dict())


def reference_source(cfg: UnirlConfig) -> ModelSource:
    if cfg.model.ref_path is not None:
        return _folder_source(cfg.model.ref_path, "model.ref_path")
    return policy_source(cfg)


def critic_source(cfg: UnirlConfig) -> ModelSource:
    hf_model = load_critic(cfg.model, cfg.critic)
    config = copy.deepcopy(hf_model.config)
    config.tie_word_embeddings = False
    weights = {k: v.detach() for k, v in hf_model.state_dict().items()}
    return ModelSource(hf_config=config, weights=weights)
