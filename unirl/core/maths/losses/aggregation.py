"""Aggregation: a per-token loss ``l_t`` of one microbatch -> its share of the step's scalar loss.

With ``m_t`` the loss mask, ``n_i`` the valid tokens of sequence i, ``G`` the valid sequences and
``N`` the valid tokens of the whole optimizer step (`GlobalCounts`), and ``L`` Dr.GRPO's constant:

- ``token-mean``:               ``sum_t m_t l_t / N``                     (DAPO; every token equal)
- ``seq-mean-token-mean``:      ``sum_i (sum_t m_t l_t / n_i) / G``        (GRPO paper, GSPO)
- ``seq-mean-token-sum``:       ``sum_i sum_t m_t l_t / G``
- ``seq-mean-token-sum-norm``:  ``sum_i sum_t m_t l_t / (G * L)``         (Dr.GRPO, Liu et al. 2025)

Each is a sum over tokens of ``w_t l_t`` divided by a step constant, so the microbatch shares add
up to the loss of the whole step, and under context parallel the shares of the CP ranks add up
too (``n_i`` is the sequence's global count).
"""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.settings import AGGREGATION_MODES


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"loss_aggregation={mode!r} is not one of {list(AGGREGATION_MODES)}")


def _per_sequence_token_weights(inp: LossInputs) -> torch.Tensor:
    """``m_t / n_{seq(t)}``: each valid sequence's tokens sum to exactly 1 (over all CP ranks)."""
    n_s = inp.seq_token_counts.to(inp.logprobs.dtype).clamp(min=1.0)  # masked seqs: 0/1, not 0/0
    return inp.mask / n_s[inp.seq_ids]


def token_weights(inp: LossInputs, mode: str) -> torch.Tensor:
    """``w_t`` of the mode: the mask, or the mask divided by the sequence's global length."""
    _check_mode(mode)
    if mode == "seq-mean-token-mean":
        return _per_sequence_token_weights(inp)
    return inp.mask


def global_normaliser(counts: GlobalCounts, mode: str) -> int:
    """The step constant the weighted token sum is divided by."""
    _check_mode(mode)
    if mode == "token-mean":
        return counts.require_tokens()
    if mode == "seq-mean-token-sum-norm":
        return counts.require_sequences() * counts.require_norm_length()
    return counts.require_sequences()


def aggregate(
    loss_t: torch.Tensor, inp: LossInputs, counts: GlobalCounts, mode: str
) -> torch.Tensor:
    """This microbatch's share of the step's loss: ``sum_t w_t l_t / D``."""
    weighted = (loss_t * token_weights(inp, mode)).sum()
    # Divide by the WHOLE step's count (all microbatches, all DP x CP ranks), never by this
    # microbatch's: then the shares sum to the step's loss and gradient whatever the split.
    return weighted / global_normaliser(counts, mode)


def aggregate_metric(
    values_t: torch.Tensor, inp: LossInputs, counts: GlobalCounts, mode: str
) -> Metric:
    """A metric that reduces (over a step) to exactly what `aggregate` computes for ``values_t``.

    The denominator is this microbatch's part of the normaliser counted from its own tokens
    (valid tokens, or sequences as ``sum_t m_t / n_i``), so it needs no global count and also
    averages correctly over several optimizer steps. Equal to the loss when ``G`` counts the
    sequences with at least one valid token.
    """
    _check_mode(mode)
    v = values_t.detach()
    if mode == "token-mean":
        return token_mean_metric(v, inp.mask)
    seq_w = _per_sequence_token_weights(inp)
    denominator = seq_w.sum()
    if mode == "seq-mean-token-sum-norm":
        denominator = denominator * counts.require_norm_length()
    numerator = (v * token_weights(inp, mode)).sum()
    return Metric(numerator=numerator, denominator=denominator, kind="sequences")


def token_mean_metric(values_t: torch.Tensor, mask_t: torch.Tensor) -> Metric:
    """Mean over valid tokens: ``sum_t m_t v_t / sum_t m_t`` (``values_t`` may be bool flags)."""
    dtype = mask_t.dtype if mask_t.dtype.is_floating_point else torch.float32
    mask = mask_t.to(dtype)
    numerator = (values_t.detach().to(dtype) * mask).sum()
    return Metric(numerator=numerator, denominator=mask.sum(), kind="tokens")


def token_max_metric(values_t: torch.Tensor, mask_t: torch.Tensor) -> Metric:
    """Max over valid tokens (reduced by max over microbatches and ranks; 0.0 with none)."""
    values = values_t.detach().masked_fill(~mask_t.bool(), float("-inf"))
    numerator = values.max() if values.numel() else values.new_tensor(float("-inf"))
    return Metric(numerator=numerator, denominator=1.0, kind="max")
