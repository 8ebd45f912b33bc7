"""Tensor views of rollout samples: the whole batch's responses padded to ``[B, L]``, and one
packed microbatch (flat tokens, cu_seqlens, position ids, masks), built by `RolloutBatch`."""

from __future__ import annotations

import attrs
import torch

from unirl.core.errors import RolloutDataError


@attrs.frozen(kw_only=True)
class PaddedResponses:
    """Responses of the whole batch as ``[B, L]`` tensors (``L`` = longest response), for
    advantage estimators that work per group or per sequence. Padding positions hold 0 and are
    False in both masks."""

    tokens: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L] bool: a real response token
    loss_mask: torch.Tensor  # [B, L] bool: a response token that is trained on
    lengths: torch.Tensor  # [B] int64 response lengths
    rollout_logprobs: torch.Tensor | None  # [B, L] float32
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    token_rewards: torch.Tensor | None = None  # [B, L] float32 (`RolloutSample.token_rewards`)


@attrs.frozen(kw_only=True)
class PackedMicrobatch:
    """Samples of one microbatch concatenated into one padding-free sequence of ``T`` tokens.

    Every per-token tensor is aligned with ``tokens`` (position ``j`` describes ``tokens[j]``,
    predicted from the logits at ``j - 1``); prompt positions are False in the masks and 0 in
    the float fields. ``cu_seqlens`` is int32, as varlen / flash attention kernels want it.
    """

    sample_indices: tuple[int, ...]  # batch index of each packed sequence, in packing order
    tokens: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32, sequence boundaries
    seq_ids: torch.Tensor  # [T] int64, 0..n-1: which packed sequence a token belongs to
    response_mask: torch.Tensor  # [T] bool: a response token
    loss_mask: torch.Tensor  # [T] bool: a response token that is trained on
    prompt_lengths: torch.Tensor  # [n] int64
    response_lengths: torch.Tensor  # [n] int64
    response_index: torch.Tensor  # [R] int64: flat positions of all response tokens, in order
    rollout_logprobs: torch.Tensor | None  # [T] float32
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None
    # [T, moe_layers, top_k] int32: the experts of input token t (-1 at each sequence's last
    # position: the router chooses there), `unirl.core.data.routed_experts`.
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def max_seqlen(self) -> int:
        lengths = self.prompt_lengths + self.response_lengths
        return int(lengths.max()) if lengths.numel() else 0

    def place_responses(self, batch_values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter a batch-level ``[B, L]`` per-response-token tensor (e.g. advantages from
        `RolloutBatch.padded_responses`) into this microbatch's ``[T]`` layout."""
        longest = int(self.response_lengths.max()) if self.response_lengths.numel() else 0
        if batch_values.dim() != 2 or batch_values.shape[1] < longest:
            raise RolloutDataError(
                f"place_responses needs a [B, L] tensor with L >= the longest response "
                f"({longest}), got shape {tuple(batch_values.shape)}"
            )
        rows = batch_values[list(self.sample_indices)]
        valid = torch.arange(rows.shape[1]) < self.response_lengths[:, None]
        out = torch.full((self.num_tokens,), fill, dtype=batch_values.dtype)
        out[self.response_index] = rows[valid]
        return out

    def responses_from_logits(self, values_t: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `place_responses` for values in *logit-position* alignment (what a
        backend returns: position ``t`` describes token ``t + 1``): one tensor per packed sequence
        with its response tokens' values, in packing order (`sample_indices`)."""
        # response token at packed position j is predicted by the logits at j - 1
        picked = values_t[self.response_index - 1]
        return list(torch.split(picked, self.response_lengths.tolist()))
