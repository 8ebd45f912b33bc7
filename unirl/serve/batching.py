"""Datums of several queued requests -> the backend's packed microbatches, and the per-token
results back to each datum.

A datum is already in unirl's logit-position alignment (position t of ``model_input`` predicts
``target_tokens[t]``), so packing is concatenation: position ids restart per datum and every
position carries its own target, mask and loss inputs. Datums are packed in order into
microbatches of at most ``tokens_per_microbatch`` tokens (a longer datum gets one of its own),
whichever request they came from: one backend call runs all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from unirl.core.data.microbatch import TrainMicrobatch


@attrs.frozen(kw_only=True)
class TokenDatum:
    """One datum as tensors ``[N]``: the inputs, targets, loss mask (the weights, or ones) and,
    for the RL losses, advantages and the sampler's log-probs."""

    tokens: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


def _cat(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(list(parts))  # type: ignore[arg-type]


def _microbatch(datums: Sequence[TokenDatum], first_index: int) -> TrainMicrobatch:
    lengths = [d.length for d in datums]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_ids = torch.repeat_interleave(torch.arange(len(datums)), torch.tensor(lengths))
    mask = torch.cat([d.mask for d in datums]).to(torch.float32)
    return TrainMicrobatch(
        sample_indices=tuple(range(first_index, first_index + len(datums))),
        tokens=torch.cat([d.tokens for d in datums]),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu,
        targets=torch.cat([d.targets for d in datums]),
        loss_mask=mask,
        seq_ids=seq_ids,
        # each datum's valid tokens (gspo's sequence ratio is a mean over them)
        seq_token_counts=torch.stack([(d.mask != 0).sum() for d in datums]).long(),
        advantages=_cat([d.advantages for d in datums]),
        old_logprobs=_cat([d.sampler_logprobs for d in datums]),
        global_cu_seqlens=cu,
    )


def pack(datums: Sequence[TokenDatum], tokens_per_microbatch: int) -> list[TrainMicrobatch]:
    """The datums in order, in microbatches of at most ``tokens_per_microbatch`` tokens."""
    out: list[TrainMicrobatch] = []
    group: list[TokenDatum] = []
    first = 0
    for i, datum in enumerate(datums):
        if group and sum(d.length for d in group) + datum.length > tokens_per_microbatch:
            out.append(_microbatch(group, first))
            group, first = [], i
        group.append(datum)
    if group:
        out.append(_microbatch(group, first))
    return out


def split_per_datum(
    microbatches: Sequence[TrainMicrobatch], per_token: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Each microbatch's ``[T]`` tensor cut back into its datums' ``[N]`` pieces, in order."""
    out: list[torch.Tensor] = []
    for mb, values in zip(microbatches, per_token, strict=True):
        out.extend(values.split(mb.sequence_lengths))
    return out
