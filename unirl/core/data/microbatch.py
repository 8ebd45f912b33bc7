"""One training microbatch as a backend receives it: packed tokens plus every per-token tensor the
loss needs, in *logit-position* alignment.

Position ``t`` of every per-token tensor here describes the prediction made by the logits at
``t``: ``targets[t]`` is token ``t+1`` of the same sequence, and ``loss_mask``, ``advantages``,
``old_logprobs`` … describe that target. The last position of each sequence predicts nothing
(mask 0). So a backend computes ``logprobs_from_logits(logits_TV, mb.targets)`` and hands the
result straight to the loss; no backend shifts anything (see `unirl.core.data.context_parallel` for the
same convention under context parallel, where the split happens after the shift).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unirl.core.data.context_parallel import CPLayout, sequence_token_counts, shift_to_next_token
from unirl.core.data.rollout import PackedMicrobatch
from unirl.core.data.routed_experts import FREE


@attrs.frozen(kw_only=True)
class TrainMicrobatch:
    sample_indices: tuple[int, ...]
    tokens: torch.Tensor  # [T] int64 input ids (CP-local when cp > 1)
    position_ids: torch.Tensor  # [T] int64, restart per sequence (global positions under CP)
    cu_seqlens: torch.Tensor  # [S+1] int32 local sequence boundaries
    targets: torch.Tensor  # [T] int64 next-token ids
    loss_mask: torch.Tensor  # [T] float32
    seq_ids: torch.Tensor  # [T] int64
    seq_token_counts: torch.Tensor  # [S] global valid targets per sequence (over CP ranks)
    advantages: torch.Tensor | None = None  # [T] float32
    old_logprobs: torch.Tensor | None = None  # None: reuse the training forward's own
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # [T] float32: the critic's regression targets (GAE)
    old_values: torch.Tensor | None = None  # [T] float32: the critic's pre-step values
    # [T, moe_layers, top_k] int32: the experts to replay for input token t (-1: the router's
    # own choice: each sequence's last token, CP padding). Input-token aligned, which is also
    # logit-position alignment (the routing of token t shapes the logits at t): never shifted.
    routed_experts: torch.Tensor | None = None
    cp_group: Any = attrs.field(default=None, eq=False)
    # Unsplit (pre-CP) stream boundaries; needed to map results back to samples.
    global_cu_seqlens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.sample_indices)

    @property
    def valid_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def sequence_lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def with_fields(self, **fields: Any) -> TrainMicrobatch:
        return attrs.evolve(self, **fields)


def build_microbatch(
    packed: PackedMicrobatch,
    *,
    advantages: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_group: Any = None,
) -> TrainMicrobatch:
    """Shift a packed microbatch to logit-position alignment, then split it for CP.

    ``advantages`` / ``old_logprobs`` / ``ref_logprobs`` / ``returns`` / ``old_values`` are
    token-aligned ``[T]`` tensors (as
    `PackedMicrobatch.place_responses` gives them); rollout and ref log-probs from the data are
    taken from ``packed`` when not given.
    """
    cu = packed.cu_seqlens.to(torch.long)

    def shift(t: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor | None:
        return None if t is None else shift_to_next_token(t, cu, fill=fill)

    loss_mask = shift(packed.loss_mask.to(torch.float32))
    assert loss_mask is not None
    fields: dict[str, torch.Tensor | None] = {
        "targets": shift(packed.tokens, 0),
        "loss_mask": loss_mask,
        "advantages": shift(advantages),
        "old_logprobs": shift(old_logprobs),
        "ref_logprobs": shift(ref_logprobs if ref_logprobs is not None else packed.ref_logprobs),
        "rollout_logprobs": shift(packed.rollout_logprobs),
        "returns": shift(returns),
        "old_values": shift(old_values),
    }
    seq_counts = sequence_token_counts(loss_mask, cu)
    if cp_size == 1:
        return TrainMicrobatch(
            sample_indices=packed.sample_indices,
            tokens=packed.tokens,
            position_ids=packed.position_ids,
            cu_seqlens=packed.cu_seqlens,
            seq_ids=packed.seq_ids,
            seq_token_counts=seq_counts,
            global_cu_seqlens=packed.cu_seqlens,
            routed_experts=packed.routed_experts,
            **fields,  # type: ignore[arg-type]
        )
    layout = CPLayout.build(cu, cp_size, cp_rank)
    split = {k: None if v is None else layout.split(v) for k, v in fields.items()}
    if packed.routed_experts is not None:
        split["routed_experts"] = layout.split(packed.routed_experts, pad_value=FREE)
    return TrainMicrobatch(
        sample_indices=packed.sample_indices,
        tokens=layout.split(packed.tokens),
        position_ids=layout.position_ids,
        cu_seqlens=layout.local_cu_seqlens.to(torch.int32),
        seq_ids=layout.seq_ids,
        seq_token_counts=seq_counts,
        cp_group=cp_group,
        global_cu_seqlens=packed.cu_seqlens,
        **split,  # type: ignore[arg-type]
    )
