"""Adapter-only weight sync (``model.lora``): the rollout engine keeps the base weights the run's
first sync sent, and after every optimizer step it receives only the adapter, in PEFT's names
(`unirl.core.backend.TrainsAdapter.adapter_state_dict`), a few MB instead of the model.

    sent = adapter_fingerprint(adapter, scale=lora.scale, dtype=torch.float32)
    receiver.load(adapter)
    compare(sent, receiver_adapter_fingerprint, receiver=..., version=v, what="adapter sync")

The verified sync (`unirl.core.weights.fingerprint`) covers the adapter with the same per-layer
statistics, on one convention both sides can compute exactly: an adapter counts as its A
matrices and its B matrices times the adapter's scale (``alpha / rank``), each cast to the
receiver's dtype before the multiplication. That is what vLLM holds: it loads B in its LoRA dtype
and folds the scale into it in place (``LoRALayerWeights.optimize``), so the engine's stacked
LoRA buffers hold exactly ``B.to(dtype) * scale``; a receiver that keeps B and the scale apart
(peft) multiplies the same way when it counts. A receiver also proves that its base weights are
the ones it started with (their fingerprint against the one taken at its first adapter sync):
an adapter sync never touches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from unirl.core.weights.fingerprint import Fingerprint

LORA_B = ".lora_B."


@runtime_checkable
class ReceivesAdapter(Protocol):
    """A rollout source that can keep its base weights and take only the adapter at a sync
    (the built-in sampler, vLLM). ``adapter``: the full adapter in PEFT's names, on the host,
    on every rank; like ``sync_weights``, every rank calls it, and it raises
    `unirl.core.weights.fingerprint.SyncVerificationError` when the receiver's check fails."""

    def sync_adapter(self, adapter: Mapping[str, torch.Tensor], *, policy_version: int) -> None: ...


def adapter_bytes(adapter: Mapping[str, torch.Tensor]) -> int:
    """What an adapter sync carries: the bytes of its tensors."""
    return sum(t.numel() * t.element_size() for t in adapter.values())


def scaled_for_fingerprint(
    name: str, tensor: torch.Tensor, *, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    """``tensor`` as the fingerprint counts it (module docstring): cast to ``dtype``, and a B
    matrix then multiplied by ``scale``."""
    t = tensor.detach().to(dtype)
    return t * scale if LORA_B in name else t


def adapter_fingerprint(
    adapter: Mapping[str, torch.Tensor], *, scale: float, dtype: torch.dtype
) -> Fingerprint:
    """The trainer's side: the fingerprint of ``adapter`` (PEFT names) as a receiver holding it
    in ``dtype`` counts it, per layer."""
    out = Fingerprint()
    for name, tensor in adapter.items():
        out.add(name, scaled_for_fingerprint(name, tensor, scale=scale, dtype=dtype))
    return out


def _linear_shapes(hf: Mapping[str, object]) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear of a Llama / Qwen-style decoder layer, from its HF config."""
    hidden, inter = int(hf["hidden_size"]), int(hf["intermediate_size"])  # type: ignore[call-overload]
    heads = int(hf["num_attention_heads"])  # type: ignore[call-overload]
    kv = int(hf.get("num_key_value_heads") or heads)  # type: ignore[call-overload]
    head_dim = int(hf.get("head_dim") or hidden // heads)  # type: ignore[call-overload]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv * head_dim),
        "v_proj": (hidden, kv * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_numel(rank: int, targets: tuple[str, ...], hf: Mapping[str, object]) -> int | None:
    """The elements of a rank-``rank`` adapter on ``targets`` of every decoder layer of the
    dense model ``hf`` (a Hugging Face config as a mapping): ``rank * (in + out)`` per target
    and layer. None where it cannot say (a config without these keys, a target it does not
    know, routed experts)."""
    try:
        shapes = _linear_shapes(hf)
        layers = int(hf["num_hidden_layers"])  # type: ignore[call-overload]
    except (KeyError, TypeError, ValueError):
        return None
    if any(t not in shapes for t in targets) or hf.get("num_experts") or hf.get("n_routed_experts"):
        return None
    return layers * sum(rank * sum(shapes[t]) for t in targets)
