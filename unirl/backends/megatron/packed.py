"""Packed (THD) model inputs for the Megatron `GPTModel`, with and without context parallel: the
form the schedules feed by default (``megatron.attention: packed``).

A `TrainMicrobatch` is one flat stream of sequences. Instead of padding it to ``[rows, L]``
(`unirl.backends.megatron.padded`) the model can read it as it is: ``input_ids [1, T_local]``
plus Megatron's `PackedSeqParams` with ``qkv_format="thd"``. ``SelfAttention`` then squeezes
q/k/v to ``[T_local, heads, D]``, applies RoPE per sequence and calls the core attention with the
params; unirl's local core attention (`SDPACoreAttention`) runs `packed_causal_attention` or, under
context parallel, `cp_packed_causal_attention`, so neither needs Transformer Engine::

    inputs = packed_model_inputs(mb, cp_size=topo.cp_size, cp_rank=topo.cp_rank, device=device)
    logits = model(inputs.input_ids, inputs.position_ids, None,
                   packed_seq_params=inputs.packed_seq_params)       # [1, T_local, V_local]

**cu_seqlens.** Every cu_seqlens field holds the GLOBAL padded boundaries
(`CPLayout.cu_seqlens_padded`, int32; each length a multiple of ``2*cp``, unpadded when cp == 1).
Megatron's THD RoPE (`_apply_rotary_pos_emb_thd`) divides them by cp itself and gives a rank's
two chunks of a sequence the positions ``[r*c, (r+1)*c)`` and ``[(2cp-1-r)*c, (2cp-r)*c)``
(``c`` = chunk length) — the global positions of `CPLayout.position_ids`, which the test checks
end to end against the HF model. ``max_seqlen_q/kv`` is the longest padded sequence: megatron
builds its RoPE table of that length.

**One stream length per schedule call.** Pipeline stages exchange activations of one shape per
call, so `schedule_items` pads every microbatch's stream to the call's longest
(`schedule_stream_tokens`) with padding *sequences* appended after the real ones (`PackedBatch`):
no real token attends to them, their logits are never read, and they are cut into pieces of at
most `PAD_PIECE` tokens so their attention costs stay linear. With token-budget microbatches,
balanced by length, the padding is small. Without pipeline parallel nothing is padded (an empty
microbatch gets one padding piece, so that every rank still runs it).

**CP state.** Under CP the core attention needs the microbatch's `CPLayout` and its
`CPAttentionIndex` (built once here, shared by every layer); they travel explicitly in
`UnirlPackedSeqParams`, a `PackedSeqParams` with three more fields, which GPTModel hands unchanged
to every layer's core attention, with a device copy of the boundaries (``cu_seqlens_device``):
without Transformer Engine the ``cu_seqlens*`` fields themselves stay on the host, because
megatron's THD RoPE reads them with ``.tolist()`` in every layer (a host sync per layer on a
device tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from unirl.backends.megatron.kernels.varlen_attention import CPAttentionIndex, max_seqlen
from unirl.backends.megatron.padded import PAD_ID
from unirl.backends.microbatch import to_device_async
from unirl.core.data.context_parallel import CPLayout, cp_pad_multiple, pad_to_cp_multiple
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.errors import LossInputError


@dataclass
class UnirlPackedSeqParams(PackedSeqParams):
    """`PackedSeqParams` plus what unirl's attention needs: the boundaries on the device, and
    under CP the layout and its attention index (None when cp == 1)."""

    cu_seqlens_device: torch.Tensor | None = None
    cp_layout: CPLayout | None = None
    cp_index: CPAttentionIndex | None = None


def packed_seq_params(
    layout: CPLayout, device: torch.device | str, *, host_boundaries: bool | None = None
) -> UnirlPackedSeqParams:
    """THD params of one microbatch split by ``layout`` (cp == 1: the trivial layout).

    ``host_boundaries`` (default: without Transformer Engine): the ``cu_seqlens*`` fields stay on
    the CPU. megatron's THD RoPE reads them with ``.tolist()`` in every layer, which on a device
    tensor is a host sync per layer that stops the CPU from queueing work ahead of the GPU;
    unirl's attention reads the device copy ``cu_seqlens_device``. TE's attention needs them on
    the device."""
    if host_boundaries is None:
        from unirl.backends.megatron.compat.te import te_available

        host_boundaries = not te_available()
    on_device = to_device_async(layout.cu_seqlens_padded.to(torch.int32), device)
    padded = layout.cu_seqlens_padded.to(torch.int32) if host_boundaries else on_device
    longest = max_seqlen(layout.cu_seqlens_padded)
    cp = layout.cp_size > 1
    return UnirlPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=padded,
        cu_seqlens_kv=padded,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        cu_seqlens_device=on_device,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cp_layout=layout if cp else None,
        cp_index=CPAttentionIndex.build(layout, device) if cp else None,
    )


@attrs.frozen(kw_only=True, eq=False)
class PackedModelInputs:
    """What `GPTModel.forward` reads for one packed microbatch on this CP rank."""

    input_ids: torch.Tensor  # [1, T_local] int64
    position_ids: torch.Tensor  # [1, T_local] int64, global position within its sequence
    packed_seq_params: UnirlPackedSeqParams
    layout: CPLayout


def packed_model_inputs(
    mb: TrainMicrobatch, *, cp_size: int, cp_rank: int, device: torch.device | str
) -> PackedModelInputs:
    """Model inputs of a `TrainMicrobatch` built with the same ``cp_size`` / ``cp_rank``
    (`build_microbatch`): its tokens are already CP-local; the layout is rebuilt from its unsplit
    boundaries ``global_cu_seqlens``."""
    return to_packed_batch(mb, cp_size=cp_size, cp_rank=cp_rank, device=device).inputs


# --- padding a call's microbatches to one stream length (pipeline parallel) -------------------

# Longest padding sequence. The padding that brings a microbatch to the call's stream length is
# cut into sequences of at most this many tokens, so its attention cost stays linear in its length.
PAD_PIECE = 256


def _global_cu(mb: TrainMicrobatch, cp_size: int) -> torch.Tensor:
    cu = mb.global_cu_seqlens if mb.global_cu_seqlens is not None else mb.cu_seqlens
    if cp_size > 1 and mb.global_cu_seqlens is None:
        raise LossInputError(
            f"TrainMicrobatch.global_cu_seqlens is None but cp_size={cp_size}: the CP layout "
            "needs the unsplit boundaries; build the microbatch with build_microbatch"
        )
    return cu.long().cpu()


def stream_tokens(mb: TrainMicrobatch, cp_size: int) -> int:
    """Global token count of the microbatch's stream once every sequence is padded for CP."""
    return int(pad_to_cp_multiple(_global_cu(mb, cp_size), cp_size)[-1])


def schedule_stream_tokens(microbatches: Sequence[TrainMicrobatch], cp_size: int) -> int:
    """The stream length that holds every microbatch of a call (at least one CP-padded piece,
    so an empty microbatch still runs)."""
    longest = max((stream_tokens(mb, cp_size) for mb in microbatches), default=0)
    return max(longest, cp_pad_multiple(cp_size))


def _pad_pieces(extra: int, cp_size: int) -> list[int]:
    unit = cp_pad_multiple(cp_size)
    piece = max(unit, PAD_PIECE // unit * unit)
    pieces = [piece] * (extra // piece)
    if extra % piece:
        pieces.append(extra % piece)
    return pieces


@attrs.frozen(kw_only=True, eq=False)
class PackedBatch:
    """One microbatch as the model reads it in the packed (THD) form: the microbatch's own
    sequences, then padding sequences up to the call's stream length ``total_tokens`` (pipeline
    stages exchange activations of one shape per call). The padding follows every real token, in
    sequences of its own, so it changes no real token's attention or logits."""

    inputs: PackedModelInputs
    real_tokens: int  # the microbatch's own (CP-local) tokens, first in the stream
    total_tokens: int  # global stream length, padding included

    @property
    def schedule_tokens(self) -> int:
        """Megatron's ``seq_length`` for the p2p shapes (global: it divides by cp itself)."""
        return self.total_tokens

    def model_kwargs(self) -> dict[str, Any]:
        return {
            "input_ids": self.inputs.input_ids,
            "position_ids": self.inputs.position_ids,
            "attention_mask": None,
            "packed_seq_params": self.inputs.packed_seq_params,
        }

    def real_logits(self, logits_1tv: torch.Tensor) -> torch.Tensor:
        """``[T, V_local]``: the logits of the microbatch's own tokens (a view, no copy).

        A view of the ``[1, T, V]`` logits, not ``logits[0]``: the backward of a select writes
        a zero ``[1, T, V]`` tensor and copies the gradient into it (3.7 ms per 16k-token
        microbatch at V = 151,936 on an H200), a view's is free. Sliced only when padding
        follows (a slice's backward makes the same zero tensor, even for the whole length)."""
        rows = logits_1tv.view(logits_1tv.shape[1:])
        return rows if rows.shape[0] == self.real_tokens else rows[: self.real_tokens]


def to_packed_batch(
    mb: TrainMicrobatch,
    *,
    cp_size: int,
    cp_rank: int,
    device: torch.device | str,
    total_tokens: int | None = None,
) -> PackedBatch:
    """`mb` (built with the same ``cp_size`` / ``cp_rank``) as model inputs, padded to a stream
    of ``total_tokens`` global tokens (default: its own length, no padding; an empty microbatch
    gets one padding piece)."""
    cu = _global_cu(mb, cp_size)
    own = stream_tokens(mb, cp_size)
    # an empty microbatch still runs (every rank joins the schedule): one padding piece
    total = max(own, cp_pad_multiple(cp_size)) if total_tokens is None else total_tokens
    extra = total - own
    if extra < 0 or extra % cp_pad_multiple(cp_size):
        raise ValueError(
            f"a microbatch of {own} stream tokens cannot be padded to {total} (cp_size="
            f"{cp_size}); compute the length with schedule_stream_tokens"
        )
    pieces = _pad_pieces(extra, cp_size)
    if pieces:
        ends = cu[-1] + torch.tensor(pieces, dtype=torch.long).cumsum(0)
        cu = torch.cat([cu, ends])
    layout = CPLayout.build(cu, cp_size, cp_rank)
    tokens = mb.tokens.to(torch.long).cpu()
    local = int(layout.local_indices.numel()) - extra // cp_size
    if tokens.shape != (local,):
        raise LossInputError(
            f"TrainMicrobatch.tokens has shape {tuple(tokens.shape)} but the CP layout "
            f"(cp_size={cp_size}, cp_rank={cp_rank}, global_cu_seqlens="
            f"{_global_cu(mb, cp_size).tolist()}) holds {local} local tokens; build the "
            "microbatch with the same cp_size / cp_rank"
        )
    if extra:
        tokens = torch.cat([tokens, torch.full((extra // cp_size,), PAD_ID, dtype=torch.long)])
    inputs = PackedModelInputs(
        input_ids=to_device_async(tokens, device)[None],
        position_ids=to_device_async(layout.position_ids, device)[None],
        packed_seq_params=packed_seq_params(layout, device),
        layout=layout,
    )
    return PackedBatch(inputs=inputs, real_tokens=local, total_tokens=total)
