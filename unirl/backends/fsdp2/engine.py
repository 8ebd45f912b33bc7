"""The models under FSDP2: `fully_shard` per decoder layer and at the root, mixed precision, CPU
offload.

Choices, and why:

- **One FSDP unit per decoder layer**, plus the root (embeddings, final norm, LM head): a layer's
  weights are gathered just before it runs and freed after, so peak memory holds one layer's full
  weights, and the next layer's all-gather overlaps this layer's compute (FSDP2 prefetches).
- **Mixed precision (bf16).** The sharded parameters stay fp32 (they are the master weights the
  optimizer updates); FSDP2 casts each gathered layer to bf16 for the forward and backward
  (``param_dtype``) and reduce-scatters gradients in fp32 (``reduce_dtype``). The fp32 masters
  start as the bf16 model upcast, so one seed names the same weights as on the other backends
  (whose bf16 init is the fp32 init rounded to bf16).
- **The optimizer** is torch's AdamW on the sharded (DTensor) parameters with unirl's LR schedule,
  as on the DeepSpeed backend (`unirl.backends.hf.optim`: same values, same checkpointed state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from unirl.backends.fsdp2.plugin import Fsdp2Options
from unirl.core.errors import ConfigError


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (``model.model.layers`` for
    Llama, Qwen, Mistral … — what HF's own `_no_split_modules` names)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"model {type(model).__name__} declares no decoder layer class (_no_split_modules); "
            "the FSDP2 backend shards one unit per decoder layer and cannot find them"
        )
    return layers


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    if dtype == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    fsdp: Fsdp2Options,
    *,
    dtype: str,
    device: torch.device,
    train: bool,
) -> torch.nn.Module:
    """`fully_shard` every decoder layer, then the root; parameters end up as DTensors on
    `device` (or in CPU memory with ``fsdp2.cpu_offload``). A trained model keeps fp32 masters;
    a frozen one (the reference) keeps its own dtype."""
    if train:
        model = model.float()  # fp32 masters; bf16 compute through the policy below
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mixed_precision(dtype) if train else MixedPrecisionPolicy(),
    }
    if fsdp.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    else:
        model = model.to(device)
    # shard_grad_op keeps the layers gathered from forward to backward; forward-only models
    # always reshard (nothing comes back for them)
    reshard = not train or fsdp.sharding != "shard_grad_op"
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    # the root's parameters (embeddings, head) are needed first by the backward: keep them
    fully_shard(model, reshard_after_forward=False if train else reshard, **kwargs)
    if fsdp.prefetch:
        set_prefetch(layers, fsdp.prefetch)
    return model


def set_prefetch(layers: list[Any], depth: int) -> None:
    """``fsdp2.prefetch``: each layer's pre-forward issues the all-gathers of the next ``depth``
    layers, and its pre-backward those of the ``depth`` layers before it (backward order)."""
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + depth])
        layer.set_modules_to_backward_prefetch(layers[max(0, i - depth) : i][::-1])
