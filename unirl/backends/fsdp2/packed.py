"""A packed microbatch through the sharded Hugging Face model: the shared varlen path
(`unirl.backends.hf.packed`: one ``[1, T]`` stream, attention kept inside each sequence), and
under Ulysses SP the same call on this rank's tokens with the exchange plan for the attention
layers."""

from __future__ import annotations

from typing import Any

import torch

from unirl.backends.fsdp2.ulysses import PLAN_KWARG, UlyssesPlan, use_ulysses_attention
from unirl.backends.hf.packed import forward_packed, use_packed_attention
from unirl.core.data.microbatch import TrainMicrobatch


def use_attention(model: Any, sp: int) -> None:
    if sp > 1:
        use_ulysses_attention(model)
    else:
        use_packed_attention(model)


def forward(module: Any, mb: TrainMicrobatch, device: torch.device, sp_group: Any) -> torch.Tensor:
    """Logits ``[T_local, V]`` (``[1, V]`` for an empty microbatch: one pad token, so every rank
    joins FSDP's collectives)."""
    if sp_group is None or mb.num_tokens == 0:
        return forward_packed(module, mb, device)
    plan = UlyssesPlan.build(mb.cu_seqlens, sp_group, device)
    out = module(
        input_ids=mb.tokens.to(device, torch.long)[None],
        position_ids=mb.position_ids.to(device, torch.long)[None],
        use_cache=False,
        **{PLAN_KWARG: plan},
    )
    return out.logits[0]
