"""Packed (THD) model inputs for the Megatron `GPTModel`, with and without context parallel.

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

**CP state.** Under CP the core attention needs the microbatch's `CPLayout` and its
`CPAttentionIndex` (built once here, shared by every layer); they travel explicitly in
`UnirlPackedSeqParams`, a `PackedSeqParams` with two more fields, which GPTModel hands unchanged
to every layer's core attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import attrs
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from unirl.backends.megatron.varlen_attention import CPAttentionIndex, max_seqlen
from unirl.core.context_parallel import CPLayout
from unirl.core.errors import LossInputError
from unirl.core.microbatch import TrainMicrobatch


@dataclass
class UnirlPackedSeqParams(PackedSeqParams):
    """`PackedSeqParams` plus what unirl's CP attention needs (None when cp == 1)."""

    cp_layout: CPLayout | None = None
    cp_index: CPAttentionIndex | None = None


def packed_seq_params(layout: CPLayout, device: torch.device | str) -> UnirlPackedSeqParams:
    """THD params of one microbatch split by ``layout`` (cp == 1: the trivial layout)."""
    padded = layout.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    longest = max_seqlen(layout.cu_seqlens_padded)
    cp = layout.cp_size > 1
    return UnirlPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=padded,
        cu_seqlens_kv=padded,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
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
    cu = mb.global_cu_seqlens if mb.global_cu_seqlens is not None else mb.cu_seqlens
    if cp_size > 1 and mb.global_cu_seqlens is None:
        raise LossInputError(
            f"TrainMicrobatch.global_cu_seqlens is None but cp_size={cp_size}: the CP layout "
            "needs the unsplit boundaries; build the microbatch with build_microbatch"
        )
    layout = CPLayout.build(cu.long().cpu(), cp_size, cp_rank)
    local = int(layout.local_indices.numel())
    if mb.tokens.shape != (local,):
        raise LossInputError(
            f"TrainMicrobatch.tokens has shape {tuple(mb.tokens.shape)} but the CP layout "
            f"(cp_size={cp_size}, cp_rank={cp_rank}, global_cu_seqlens={cu.tolist()}) holds "
            f"{local} local tokens; build the microbatch with the same cp_size / cp_rank"
        )
    return PackedModelInputs(
        input_ids=mb.tokens.to(device=device, dtype=torch.long)[None],
        position_ids=layout.position_ids.to(device)[None],
        packed_seq_params=packed_seq_params(layout, device),
        layout=layout,
    )
