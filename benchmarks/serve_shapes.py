"""The model shapes `benchmarks/serve_overhead.py` measures `unirl serve` on: the model, its LoRA
adapter, the step's datums and the server's ``train`` section, per ``--shape``.

``tiny`` is the CPU row (a 4-layer, 256-wide Llama). ``qwen3-4b`` is issue 47's one-GPU row:
Qwen3-4B's shape as `benchmarks/megatron_throughput.py` builds it (36 layers, hidden 2,560,
intermediate 9,728, GQA 32 / 8 with q / k norm, vocabulary 151,936, tied embeddings) with the
settings of the LoRA rows of `benchmarks/long_sequences.sh` (rank 16, alpha 32, on every decoder
linear; one 16,384-token sequence per microbatch; the fused head; activation recompute,
Megatron's on the first 12 layers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import attrs
import torch

from benchmarks.megatron_throughput import MODELS

TINY = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
# Megatron's recompute of the issue-49 4B LoRA row (`long_sequences.sh` m4b-16k-lora)
RECOMPUTE_LAYERS = 12


@attrs.frozen(kw_only=True)
class Shape:
    """One ``--shape``: the model and what a step of it is (``--datums`` / ``--tokens`` and the
    overrides replace the defaults here)."""

    model: dict[str, Any]
    lora_rank: int
    lora_alpha: float | None  # None: unirl's default
    # the SDK's train_unembed: LoRA on the LM head too (Megatron cannot train a tied one)
    train_unembed: bool
    datums: int
    tokens: int
    fused_head_and_recompute: bool  # the 4B LoRA rows' memory settings


SHAPES: dict[str, Shape] = {
    "tiny": Shape(
        model=TINY,
        lora_rank=8,
        lora_alpha=None,
        train_unembed=True,
        datums=8,
        tokens=256,
        fused_head_and_recompute=False,
    ),
    "qwen3-4b": Shape(
        model=MODELS["qwen3-4b"],
        lora_rank=16,
        lora_alpha=32.0,
        train_unembed=False,
        datums=1,
        tokens=16384,
        fused_head_and_recompute=True,
    ),
}


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """``--shape``'s model with the smoke-run overrides ``--layers``, ``--hidden`` (heads of
    128 dimensions, ``4 x hidden`` intermediate) and ``--vocab``; the position table as long as a
    datum."""
    hf = dict(SHAPES[args.shape].model)
    if args.layers is not None:
        hf["num_hidden_layers"] = args.layers
    if args.hidden is not None:
        head_dim = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        heads = max(1, args.hidden // head_dim)
        hf.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden)
        hf.update(num_attention_heads=heads)
        hf["num_key_value_heads"] = min(hf["num_key_value_heads"], heads)
    if args.vocab is not None:
        hf["vocab_size"] = args.vocab
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.tokens)
    return hf


def train_section(args: argparse.Namespace, hf: dict[str, Any]) -> dict[str, Any]:
    """The server's ``train`` section (the backend's config but for ``model.path`` / ``lora``
    targets and ``batch``, which the server sets)."""
    shape = SHAPES[args.shape]
    model: dict[str, Any] = {"max_seq_len": max(1024, args.tokens)}
    if args.dtype != "fp32":
        model["dtype"] = args.dtype
    if shape.lora_alpha is not None:
        model["lora"] = {"alpha": shape.lora_alpha}  # the template of every client's adapter
    train: dict[str, Any] = {"backend": args.backend, "model": model}
    if shape.fused_head_and_recompute:
        model.update(fused_head=True, gradient_checkpointing=True)
        if args.backend == "megatron":
            layers = hf["num_hidden_layers"]
            train["megatron"] = {"recompute_layers": min(RECOMPUTE_LAYERS, layers)}
    return train


def save_model(hf: dict[str, Any], folder: Path, dtype: str, device: str) -> Path:
    """Random weights of shape ``hf`` as a Hugging Face folder (seed 0), built on ``device``
    (a 4B model initialises in seconds on a GPU); kept when ``folder`` already holds this shape
    (the GPU script's runs share one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    marker = folder / "serve_shape.json"
    if marker.exists() and json.loads(marker.read_text()) == {"model": hf, "dtype": dtype}:
        return folder
    torch.manual_seed(0)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=torch_dtype)
    model.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    marker.write_text(json.dumps({"model": hf, "dtype": dtype}))
    return folder
