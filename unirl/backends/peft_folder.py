"""A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), written and
read the same way by every backend, so one trained adapter means the same on DeepSpeed, FSDP2 and
Megatron and loads with ``peft.PeftModel.from_pretrained`` onto the base model.

The tensors are named as ``peft.get_peft_model_state_dict`` names them
(``base_model.model.<HF module path>.lora_A.weight``, A ``[rank, in]``, B ``[out, rank]``); the
config is PEFT's own `peft.LoraConfig`, so the folder's format is PEFT's, not a copy of it.
Rank 0 writes into ``<path>.partial`` and renames it: a crash leaves no half-written adapter."""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The Hugging Face targets a fused expert tensor can hold (`unirl.backends.peft_experts`).
EXPERT_TARGETS = {"gate_proj", "up_proj", "down_proj"}


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - the lora extra is missing
        raise ConfigError("model.lora needs the peft package: pip install 'unirl[lora]'") from exc
    return peft


def peft_lora_config(
    lora: LoraConfig, *, base_model: str | None = None, target_parameters: list[str] | None = None
) -> Any:
    """``model.lora`` as `peft.LoraConfig` (what the HF backends wrap with and every backend's
    exported ``adapter_config.json`` holds)."""
    return _peft().LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        target_parameters=target_parameters,
        base_model_name_or_path=base_model,
        inference_mode=True,
    )


def write_peft_folder(
    state: Mapping[str, torch.Tensor],
    lora: LoraConfig,
    path: Path,
    *,
    base_model: str | None = None,
    target_parameters: list[str] | None = None,
) -> None:
    """Write ``state`` (PEFT names, full tensors) and ``lora``'s PEFT config into ``path``
    (call on one rank)."""
    from safetensors.torch import save_file

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = peft_lora_config(lora, base_model=base_model, target_parameters=target_parameters)
    config.save_pretrained(str(partial))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
    if path.exists():
        shutil.rmtree(path)
    os.replace(partial, path)


def read_peft_folder(path: str | Path, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """The tensors of the PEFT adapter at ``path`` (``model.lora.path``), after checking that its
    rank, alpha and targets are ``lora``'s (a mismatch is a `ConfigError` naming both)."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    config_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights.is_file():
        raise ConfigError(
            f"model.lora.path={str(path)!r} holds no PEFT adapter ({CONFIG_FILE} and "
            f"{WEIGHTS_FILE}); give a folder written by peft's save_pretrained or unirl's export"
        )
    saved = json.loads(config_file.read_text())
    want = {"r": lora.rank, "lora_alpha": lora.alpha}
    for key, value in want.items():
        if float(saved.get(key, -1)) != float(value):
            raise ConfigError(
                f"model.lora.path: the adapter has {key}={saved.get(key)!r}, model.lora says "
                f"{value!r}; set model.lora to the adapter's values"
            )
    targets = saved.get("target_modules") or []
    # peft's own save drops the targets only its expert tensors hold (target_parameters)
    expert_only = (
        set(lora.target_modules) - set(targets) if saved.get("target_parameters") else set()
    )
    if isinstance(targets, str) or sorted(set(targets) | (expert_only & EXPERT_TARGETS)) != sorted(
        lora.target_modules
    ):
        raise ConfigError(
            f"model.lora.path: the adapter targets {targets!r}, model.lora.target_modules is "
            f"{list(lora.target_modules)}; set model.lora.target_modules to the adapter's"
        )
    return load_file(str(weights))


def initial_lora_a(name: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """A's starting value (fp32 ``[rank, in_features]``) of the adapter whose PEFT name is
    ``name`` (``base_model.model.<module>.lora_A.weight``), the same on every backend and
    layout: uniform in +-1/sqrt(in_features) (peft's ``kaiming_uniform_(a=sqrt(5))`` bound),
    drawn from a generator seeded with ``seed + crc32(name)``. So ``model.lora.init_seed`` gives
    one adapter whichever backend trains it (peft's own draw depends on the module order and the
    global RNG); B starts at zero."""
    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound
