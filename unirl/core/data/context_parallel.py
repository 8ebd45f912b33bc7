"""Context parallel (CP): how packed sequences are split across ranks, and how sequence-level
quantities and the loss scale come back together.

**Layout (Megatron / Transformer Engine's load-balanced convention).** A microbatch is a flat
stream of ``S`` packed sequences with ``cu_seqlens`` (int, ``[S+1]``). With ``cp`` ranks each
sequence is first padded at its end to a multiple of ``2*cp`` tokens (``cp == 1``: no padding),
then cut into ``2*cp`` equal chunks; rank ``r`` holds chunk ``r`` followed by chunk
``2*cp-1-r``. Under a causal mask early chunks are cheap and late chunks are expensive, so pairing
them gives every rank the same attention work. Example, one 8-token sequence, ``cp=2``: chunks of
2 tokens; rank 0 holds global positions ``[0, 1, 6, 7]``, rank 1 holds ``[2, 3, 4, 5]``. The local
stream of a rank is its pieces of all sequences in sequence order, so every rank holds
``padded_total / cp`` tokens and the local ``cu_seqlens`` is ``cu_seqlens_padded // cp`` on every
rank.

**Padding.** Padded positions get ``pad_value`` (default 0) in every split tensor: token id 0,
loss mask 0, advantages 0. They sit at the end of their sequence, so under a causal mask no real
token attends to them, and their loss mask 0 removes them from every sum. A sequence shorter than
``2*cp`` tokens still has ``2*cp`` padded positions; some ranks then hold only padding of it
(zero valid tokens there) — nothing divides by a *local* count and every rank still joins every
collective, so nothing hangs.

**Attention.** A rank's two chunks of a sequence are not contiguous in the sequence. RoPE and the
causal mask must use the *global* positions of the local tokens (`CPLayout.position_ids`): a
query at global position ``p`` attends to the keys of the same sequence at global positions
``<= p``, which live partly on other ranks (ring attention or a key/value all-gather — the
attention kernel's job, not this module's). `CPLayout.local_cu_seqlens` describes the local
query layout (each local piece is the two chunks, ``2 * chunk`` tokens).

**Next-token targets.** The log-prob of token ``t+1`` is predicted at position ``t``. Shift on the
GLOBAL (unsplit) stream first — ``targets_t = tokens_{t+1}`` within each sequence; the last
position of a sequence has no target, so its loss mask is 0 (`shift_to_next_token`) — then split
tokens, targets, loss mask, advantages and old log-probs identically. Each rank then computes the
log-probs of its own positions from its own logits, with no neighbour exchange.

**Sequence-level quantities.** The global valid-token count of each sequence (for
seq-mean-token-mean, GSPO's length normalisation) is computed from the unsplit stream before the
split (`sequence_token_counts`), never from local tokens. Per-sequence sums of per-token values
(GSPO's sequence log-ratio, returns, sequence masks) are local sums followed by `cp_all_reduce`,
an autograd-aware all-reduce: its backward all-reduces the gradient, so the gradient of every
rank's loss reaches every rank's local tokens. Rule that keeps this exact: a replicated sequence
quantity may only be used inside per-token terms summed over *local* tokens; a term added once
per sequence must be added on one CP rank only, or it counts ``cp`` times.

**Loss scale.** Every rank divides by the same global normalisers (`GlobalCounts`, counted once
over the whole step across DP x CP on the unsplit streams, and the global per-sequence counts
above). The local token sets of the CP ranks partition the real tokens, so the local losses of the
CP ranks sum to the CP=1 loss, and their gradients (with the all-reduce backward) sum to the CP=1
gradient. Megatron all-reduces gradients over the dp-with-cp group and *averages* (divides by
``dp * cp``), and its schedule divides each microbatch loss by the microbatch count; the backend
(not this module) multiplies the loss by ``dp * cp`` (and the microbatch count) to cancel that
averaging, so the applied gradient is exactly the gradient of the global objective. (E.g. dp=2,
cp=2: the four ranks' gradients are summed and divided by 4; the backend's factor 4 cancels it.)

Usage, per microbatch on each CP rank::

    lay = CPLayout.build(cu_seqlens, topology.cp_size, topology.cp_rank)
    targets = shift_to_next_token(tokens, cu_seqlens)                  # global stream
    loss_mask = shift_to_next_token(response_mask, cu_seqlens, fill=False)
    seq_counts = sequence_token_counts(loss_mask, cu_seqlens)          # global, before the split
    logits = model(lay.split(tokens), position_ids=lay.position_ids, cu_seqlens=lay.local_cu_seqlens)
    logprobs = logprobs_from_logits(logits, lay.split(targets), tp_group=topology.groups.tp)
    LossInputs(logprobs=logprobs, loss_mask=lay.split(loss_mask), seq_ids=lay.seq_ids,
               seq_token_counts=seq_counts, cp_group=topology.groups.cp, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import ConfigError, LossInputError


def _check_cu_seqlens(cu_seqlens: torch.Tensor, name: str = "cu_seqlens") -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise LossInputError(f"{name} must be 1-D [S+1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise LossInputError(f"{name} must be an integer tensor, got dtype {cu_seqlens.dtype}")
    if int(cu_seqlens[0]) != 0:
        raise LossInputError(f"{name}[0] must be 0, got {int(cu_seqlens[0])}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0])
        raise LossInputError(
            f"{name} must be non-decreasing; sequence {bad} has length {int(lengths[bad])} "
            f"(cu_seqlens[{bad}]={int(cu_seqlens[bad])}, cu_seqlens[{bad + 1}]="
            f"{int(cu_seqlens[bad + 1])})"
        )


def _check_cp(cp_size: int, cp_rank: int | None = None) -> None:
    if cp_size < 1:
        raise ConfigError(f"cp_size must be >= 1, got {cp_size}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ConfigError(f"cp_rank={cp_rank} outside [0, cp_size={cp_size})")


def _check_per_token(tensor_t: torch.Tensor, cu_seqlens: torch.Tensor, name: str) -> None:
    total = int(cu_seqlens[-1])
    if tensor_t.dim() < 1 or tensor_t.shape[0] != total:
        raise LossInputError(
            f"{name} must have the packed token count cu_seqlens[-1]={total} as its first "
            f"dimension, got shape {tuple(tensor_t.shape)}"
        )


def _seq_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence index of every position of the stream described by ``cu_seqlens``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def cp_pad_multiple(cp_size: int) -> int:
    """Every sequence's length is padded to a multiple of this: ``2*cp``, or 1 without CP."""
    _check_cp(cp_size)
    return 2 * cp_size if cp_size > 1 else 1


def pad_to_cp_multiple(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``cu_seqlens`` after padding each sequence at its end to a multiple of `cp_pad_multiple`."""
    _check_cu_seqlens(cu_seqlens)
    m = cp_pad_multiple(cp_size)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    padded = (lengths + m - 1) // m * m
    return torch.cat([padded.new_zeros(1), torch.cumsum(padded, 0)])


def padded_positions(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """For each token of the unpadded stream, its index in the padded stream ([T], long)."""
    seq = _seq_ids(cu_seqlens)
    t = torch.arange(seq.numel(), device=cu_seqlens.device)
    return t - cu_seqlens.long()[seq] + cu_seqlens_padded.long()[seq]


def cp_local_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Indices into the padded global stream of the tokens rank ``cp_rank`` holds, in local order:
    for each sequence, chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank``."""
    _check_cu_seqlens(cu_seqlens_padded, "cu_seqlens_padded")
    _check_cp(cp_size, cp_rank)
    starts = cu_seqlens_padded[:-1].long()
    lengths = cu_seqlens_padded[1:].long() - starts
    if cp_size == 1:
        return torch.arange(int(cu_seqlens_padded[-1]), device=cu_seqlens_padded.device)
    m = 2 * cp_size
    if bool((lengths % m != 0).any()):
        bad = int(torch.nonzero(lengths % m)[0])
        raise LossInputError(
            f"cu_seqlens_padded: sequence {bad} has length {int(lengths[bad])}, not a multiple of "
            f"2*cp_size={m}; pass the output of pad_to_cp_multiple(cu_seqlens, {cp_size})"
        )
    chunk = lengths // m
    local_cu = cu_seqlens_padded.long() // cp_size
    seq = _seq_ids(local_cu)
    offset = torch.arange(seq.numel(), device=seq.device) - local_cu[seq]  # offset in local piece
    c = chunk[seq]
    second = offset >= c
    chunk_idx = torch.where(second, torch.full_like(offset, m - 1 - cp_rank), cp_rank)
    return starts[seq] + chunk_idx * c + offset - second.long() * c


def cp_local_cu_seqlens(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """``cu_seqlens`` of the local stream (the same on every rank): each piece is two chunks."""
    _check_cp(cp_size)
    return cu_seqlens_padded.long() // cp_size


def cp_local_seq_ids(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Sequence index of every local token ([T_local], long; the same on every rank)."""
    return _seq_ids(cp_local_cu_seqlens(cu_seqlens_padded, cp_size))


def cp_local_position_ids(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Global position within its sequence of every local token: what RoPE and the causal mask
    must use (the two local chunks of a sequence are far apart in the sequence)."""
    idx = cp_local_indices(cu_seqlens_padded, cp_size, cp_rank)
    seq = cp_local_seq_ids(cu_seqlens_padded, cp_size)
    return idx - cu_seqlens_padded.long()[seq]


def split_for_cp(
    tensor_t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    pad_value: float | int | bool = 0,
) -> torch.Tensor:
    """The CP-local part of any per-token tensor ``[T, ...]`` (tokens, targets, positions, loss
    mask, advantages, old log-probs): pad each sequence with ``pad_value``, keep this rank's
    chunks. Differentiable (padding is out of place), so it also maps tensors with gradients."""
    _check_cu_seqlens(cu_seqlens)
    _check_cp(cp_size, cp_rank)
    _check_per_token(tensor_t, cu_seqlens, "tensor_t")
    if cp_size == 1:
        return tensor_t
    padded_cu = pad_to_cp_multiple(cu_seqlens, cp_size)
    pos = padded_positions(cu_seqlens, padded_cu)
    local = cp_local_indices(padded_cu, cp_size, cp_rank)
    return _pad_and_take(tensor_t, pos, int(padded_cu[-1]), local, pad_value)


def _pad_and_take(
    tensor_t: torch.Tensor,
    pos: torch.Tensor,
    padded_total: int,
    local: torch.Tensor,
    pad_value: float | int | bool,
) -> torch.Tensor:
    padded = tensor_t.new_full((padded_total, *tensor_t.shape[1:]), pad_value)
    padded = padded.index_copy(0, pos.to(tensor_t.device), tensor_t)  # out of place: autograd
    return padded[local.to(tensor_t.device)]


def merge_cp_pieces(pieces: Sequence[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_for_cp` over all ranks: ``pieces[r]`` is rank r's local tensor; returns
    the unpadded global ``[T, ...]`` tensor (padding dropped). No communication."""
    _check_cu_seqlens(cu_seqlens)
    cp_size = len(pieces)
    _check_cp(cp_size)
    if cp_size == 1:
        return pieces[0]
    padded_cu = pad_to_cp_multiple(cu_seqlens, cp_size)
    local_total = int(padded_cu[-1]) // cp_size
    for r, p in enumerate(pieces):
        if p.dim() < 1 or p.shape[0] != local_total:
            raise LossInputError(
                f"pieces[{r}] must have {local_total} local tokens (padded total "
                f"{int(padded_cu[-1])} / cp_size {cp_size}), got shape {tuple(p.shape)}"
            )
    device = pieces[0].device
    order = torch.cat([cp_local_indices(padded_cu, cp_size, r) for r in range(cp_size)])
    padded = torch.cat(list(pieces)).index_select(0, torch.argsort(order.to(device)))
    return padded[padded_positions(cu_seqlens, padded_cu).to(device)]


def gather_from_cp(local_t: torch.Tensor, cu_seqlens: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """All-gather a CP-local per-token tensor back to the global unpadded order, on every rank.

    For tests and metrics: the result is detached (no gradient flows back through it). Every rank
    of ``cp_group`` must call it; ``cp_group=None`` means CP is off (returns ``local_t``).
    """
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return local_t
    cp_size = dist.get_world_size(cp_group)
    local = local_t.detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(pieces, local, group=cp_group)
    return merge_cp_pieces(pieces, cu_seqlens)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a group; the backward sums the incoming gradients over the same group.

    Written out instead of ``torch.distributed.nn.functional.all_reduce`` (deprecated in recent
    torch) and the functional collectives (differentiable only in recent torch), so it behaves
    the same on every supported torch.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # y = sum_r x_r is replicated; the objective is the sum of every rank's loss, so
        # dL/dx_r = sum_r' dL_r'/dy: the same all-reduce, on the gradients.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def cp_all_reduce(tensor: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """Sum over the CP group with gradients: backward all-reduces the incoming gradients, so each
    rank's local inputs get the gradient of the sum of every rank's loss. Every rank of the group
    must call it (and later run backward through it, if any rank does). ``None``: identity."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return tensor
    return _AllReduceSum.apply(tensor, cp_group)


def shift_to_next_token(
    values_t: torch.Tensor, cu_seqlens: torch.Tensor, fill: float | int | bool = 0
) -> torch.Tensor:
    """``out[t] = values[t+1]`` within each sequence; the last position of each sequence gets
    ``fill``. Apply on the GLOBAL stream before `split_for_cp`: tokens -> next-token targets
    (the token whose log-prob position ``t`` predicts), response mask -> loss mask per
    prediction position (``fill=0``: the last position has no target)."""
    _check_cu_seqlens(cu_seqlens)
    _check_per_token(values_t, cu_seqlens, "values_t")
    out = values_t.new_full(values_t.shape, fill)
    if values_t.shape[0] == 0:
        return out
    ends = cu_seqlens[1:].long() - 1
    has_next = torch.ones(values_t.shape[0], dtype=torch.bool, device=values_t.device)
    has_next[ends[cu_seqlens[1:] > cu_seqlens[:-1]]] = False  # empty sequences have no end
    src = torch.nonzero(has_next).squeeze(1)
    out[src] = values_t[src + 1]
    return out


def sequence_token_counts(loss_mask_t: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Valid (loss-mask) tokens of each sequence, ``[S]`` long, from the GLOBAL unsplit stream —
    the denominator of seq-mean-token-mean and GSPO, identical on every CP rank."""
    _check_cu_seqlens(cu_seqlens)
    _check_per_token(loss_mask_t, cu_seqlens, "loss_mask_t")
    num_seqs = cu_seqlens.numel() - 1
    counts = torch.zeros(num_seqs, dtype=torch.long, device=loss_mask_t.device)
    return counts.index_add(
        0, _seq_ids(cu_seqlens).to(loss_mask_t.device), (loss_mask_t != 0).long()
    )


@attrs.frozen(kw_only=True, eq=False)
class CPLayout:
    """Everything one CP rank needs about the split of one packed microbatch.

    Build once per microbatch with `CPLayout.build` (from plan data on the CPU; move what the
    model needs to its device); use `split` on every per-token tensor of the global stream
    (after `shift_to_next_token`) and `gather` to bring local results back.
    """

    cp_size: int
    cp_rank: int
    cu_seqlens: torch.Tensor  # [S+1] global, unpadded
    cu_seqlens_padded: torch.Tensor  # [S+1] global, each length a multiple of cp_pad_multiple
    local_indices: torch.Tensor  # [T_local] indices into the padded global stream
    local_cu_seqlens: torch.Tensor  # [S+1] local stream (the attention's query layout)
    position_ids: torch.Tensor  # [T_local] global position within its sequence (RoPE, mask)
    seq_ids: torch.Tensor  # [T_local] sequence index of each local token
    padded_positions: torch.Tensor  # [T] index in the padded stream of each global token

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> CPLayout:
        _check_cu_seqlens(cu_seqlens)
        _check_cp(cp_size, cp_rank)
        padded = pad_to_cp_multiple(cu_seqlens, cp_size)
        idx = cp_local_indices(padded, cp_size, cp_rank)
        seq = cp_local_seq_ids(padded, cp_size)
        return cls(
            cp_size=cp_size,
            cp_rank=cp_rank,
            cu_seqlens=cu_seqlens.long(),
            cu_seqlens_padded=padded,
            local_indices=idx,
            local_cu_seqlens=cp_local_cu_seqlens(padded, cp_size),
            position_ids=idx - padded[seq],
            seq_ids=seq,
            padded_positions=padded_positions(cu_seqlens, padded),
        )

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def split(self, tensor_t: torch.Tensor, pad_value: float | int | bool = 0) -> torch.Tensor:
        """`split_for_cp` with this layout's precomputed indices."""
        _check_per_token(tensor_t, self.cu_seqlens, "tensor_t")
        if self.cp_size == 1:
            return tensor_t
        padded_total = int(self.cu_seqlens_padded[-1])
        return _pad_and_take(
            tensor_t, self.padded_positions, padded_total, self.local_indices, pad_value
        )

    def gather(self, local_t: torch.Tensor, cp_group: Any) -> torch.Tensor:
        return gather_from_cp(local_t, self.cu_seqlens, cp_group)
