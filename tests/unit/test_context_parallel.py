"""The CP split convention against hand-written layouts, and its round trips."""

from __future__ import annotations

import pytest
import torch

from unirl.core.data.context_parallel import (
    CPLayout,
    cp_local_cu_seqlens,
    cp_local_indices,
    cp_local_position_ids,
    cp_local_seq_ids,
    cp_pad_multiple,
    merge_cp_pieces,
    pad_to_cp_multiple,
    padded_positions,
    sequence_token_counts,
    shift_to_next_token,
    split_for_cp,
)
from unirl.core.errors import ConfigError, LossInputError


def cu(*lengths: int) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out)


# -- chunk assignment ----------------------------------------------------------------------


def test_single_sequence_cp2_matches_megatron_layout():
    # 8 tokens, cp=2 -> 4 chunks of 2: [0,1] [2,3] [4,5] [6,7]; rank 0 chunks 0 and 3, rank 1 1 and 2.
    c = torch.tensor([0, 8])
    assert cp_local_indices(c, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_local_indices(c, 2, 1).tolist() == [2, 3, 4, 5]


def test_single_sequence_cp4():
    # 8 tokens, cp=4 -> 8 chunks of 1; rank r holds r and 7-r.
    c = torch.tensor([0, 8])
    assert [cp_local_indices(c, 4, r).tolist() for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]


def test_cp1_is_identity():
    c = cu(3, 1, 4)
    assert pad_to_cp_multiple(c, 1).tolist() == [0, 3, 4, 8]
    assert cp_local_indices(c, 1, 0).tolist() == list(range(8))
    x = torch.arange(8.0)
    assert split_for_cp(x, c, 1, 0) is x


def test_packed_layout_cp2_by_hand():
    # lengths 5, 2, 8 -> padded to multiples of 4: 8, 4, 8 -> cu [0, 8, 12, 20].
    c = cu(5, 2, 8)
    assert cp_pad_multiple(2) == 4
    padded = pad_to_cp_multiple(c, 2)
    assert padded.tolist() == [0, 8, 12, 20]
    # seq 0 (start 0, chunk 2): r0 [0,1,6,7], r1 [2,3,4,5]
    # seq 1 (start 8, chunk 1): r0 [8,11],    r1 [9,10]
    # seq 2 (start 12, chunk 2): r0 [12,13,18,19], r1 [14,15,16,17]
    assert cp_local_indices(padded, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]
    assert cp_local_indices(padded, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 14, 15, 16, 17]
    # positions within the sequence = index - padded sequence start
    assert cp_local_position_ids(padded, 2, 0).tolist() == [0, 1, 6, 7, 0, 3, 0, 1, 6, 7]
    assert cp_local_position_ids(padded, 2, 1).tolist() == [2, 3, 4, 5, 1, 2, 2, 3, 4, 5]
    # local pieces are 4, 2, 4 tokens on both ranks
    assert cp_local_cu_seqlens(padded, 2).tolist() == [0, 4, 6, 10]
    assert cp_local_seq_ids(padded, 2).tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
    # padded stream index of each real token: seq0 0..4, seq1 8..9, seq2 12..19
    assert padded_positions(c, padded).tolist() == [0, 1, 2, 3, 4, 8, 9, *range(12, 20)]


def test_split_values_by_hand():
    c = cu(5, 2, 8)
    x = torch.arange(1, 16)  # seq0 = 1..5, seq1 = 6,7, seq2 = 8..15; pad shown as -1
    # padded stream: [1,2,3,4,5,-1,-1,-1, 6,7,-1,-1, 8..15]
    assert split_for_cp(x, c, 2, 0, pad_value=-1).tolist() == [1, 2, -1, -1, 6, -1, 8, 9, 14, 15]
    assert split_for_cp(x, c, 2, 1, pad_value=-1).tolist() == [3, 4, 5, -1, 7, -1, 10, 11, 12, 13]


def test_layout_object_agrees_with_functions():
    c = cu(5, 2, 8)
    lay = CPLayout.build(c, 2, 1)
    assert lay.num_seqs == 3
    assert lay.cu_seqlens_padded.tolist() == [0, 8, 12, 20]
    assert lay.local_indices.tolist() == [2, 3, 4, 5, 9, 10, 14, 15, 16, 17]
    assert lay.position_ids.tolist() == [2, 3, 4, 5, 1, 2, 2, 3, 4, 5]
    assert lay.local_cu_seqlens.tolist() == [0, 4, 6, 10]
    assert lay.seq_ids.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
    mask = torch.ones(15, dtype=torch.bool)
    assert lay.split(mask).tolist() == [True] * 3 + [False, True, False] + [True] * 4


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_causal_work_is_balanced(cp):
    # Causal attention work of a query at position p is p+1 keys; every rank gets the same sum.
    c = torch.tensor([0, 12 * cp])
    padded = pad_to_cp_multiple(c, cp)
    work = [int((cp_local_position_ids(padded, cp, r) + 1).sum()) for r in range(cp)]
    # total work n(n+1)/2 with n = 12cp, split evenly
    n = 12 * cp
    assert work == [n * (n + 1) // 2 // cp] * cp


# -- short sequences -----------------------------------------------------------------------


def test_one_token_sequence_cp2():
    # 1 token -> padded to 4 positions [x, pad, pad, pad]; rank 0 holds 0 and 3, rank 1 1 and 2.
    c = cu(1, 8)
    padded = pad_to_cp_multiple(c, 2)
    assert padded.tolist() == [0, 4, 12]
    mask = torch.ones(9, dtype=torch.bool)
    m0 = split_for_cp(mask, c, 2, 0)
    m1 = split_for_cp(mask, c, 2, 1)
    assert m0[:2].tolist() == [True, False]  # rank 0 holds the token and one pad
    assert m1[:2].tolist() == [False, False]  # rank 1 holds only padding of sequence 0
    assert cp_local_position_ids(padded, 2, 0)[:2].tolist() == [0, 3]
    assert cp_local_position_ids(padded, 2, 1)[:2].tolist() == [1, 2]


def test_three_token_sequence_cp4():
    # 3 tokens -> 8 positions, chunks of 1: rank r holds positions r and 7-r; ranks 0..2 hold one
    # real token each, rank 3 holds only padding.
    c = cu(3)
    x = torch.tensor([10, 11, 12])
    got = [split_for_cp(x, c, 4, r, pad_value=-1).tolist() for r in range(4)]
    assert got == [[10, -1], [11, -1], [12, -1], [-1, -1]]


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_merge_round_trip(cp):
    g = torch.Generator().manual_seed(cp)
    lengths = [1, 7, 2 * cp, 0, 2 * cp + 1, 13]
    c = cu(*lengths)
    x = torch.randn(int(c[-1]), 3, generator=g)
    pieces = [split_for_cp(x, c, cp, r) for r in range(cp)]
    padded_total = int(pad_to_cp_multiple(c, cp)[-1])
    assert all(p.shape == (padded_total // cp, 3) for p in pieces)
    assert torch.equal(merge_cp_pieces(pieces, c), x)


@pytest.mark.parametrize("cp", [2, 3])
def test_ranks_partition_the_padded_stream(cp):
    padded = pad_to_cp_multiple(cu(1, 5, 9, 2), cp)
    allidx = torch.cat([cp_local_indices(padded, cp, r) for r in range(cp)])
    assert sorted(allidx.tolist()) == list(range(int(padded[-1])))


def test_split_is_differentiable():
    c = cu(5, 2, 8)
    x = torch.arange(15.0, requires_grad=True)
    w = torch.arange(1.0, 11.0)
    (split_for_cp(x, c, 2, 1) * w).sum().backward()
    # rank 1 holds real tokens 2,3,4 (w 1,2,3), 6 (w 5), 9..12 (w 7..10); the rest get 0.
    expect = [0, 0, 1, 2, 3, 0, 5, 0, 0, 7, 8, 9, 10, 0, 0]
    assert x.grad.tolist() == expect


# -- targets and counts --------------------------------------------------------------------


def test_shift_to_next_token():
    c = cu(3, 0, 2, 1)
    tokens = torch.tensor([11, 12, 13, 21, 22, 31])
    # seq0 -> [12, 13, pad], empty seq, seq2 -> [22, pad], seq3 -> [pad]
    assert shift_to_next_token(tokens, c).tolist() == [12, 13, 0, 22, 0, 0]
    response = torch.tensor([0, 1, 1, 1, 1, 1], dtype=torch.bool)
    # loss mask at prediction positions: response[t+1], last position of each sequence False
    assert shift_to_next_token(response, c).tolist() == [True, True, False, True, False, False]


def test_shift_then_split_keeps_pairs():
    # Each local position still pairs a token with its global successor, with no exchange.
    c = cu(6, 3)
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    targets = shift_to_next_token(tokens, c, fill=-1)
    # rank 0 of cp=2: seq0 padded 8 -> positions [0,1,6,7]; seq1 padded 4 -> [0,3]
    assert split_for_cp(tokens, c, 2, 0, -1).tolist() == [1, 2, -1, -1, 7, -1]
    assert split_for_cp(targets, c, 2, 0, -1).tolist() == [2, 3, -1, -1, 8, -1]


def test_sequence_token_counts():
    c = cu(3, 0, 2, 1)
    mask = torch.tensor([1, 0, 1, 1, 1, 0])
    assert sequence_token_counts(mask, c).tolist() == [2, 0, 2, 0]


# -- bad input -----------------------------------------------------------------------------


def test_bad_inputs_raise_named_errors():
    c = cu(5, 2)
    with pytest.raises(LossInputError, match=r"tensor_t.*cu_seqlens\[-1\]=7"):
        split_for_cp(torch.zeros(6), c, 2, 0)
    with pytest.raises(LossInputError, match=r"non-decreasing; sequence 1"):
        pad_to_cp_multiple(torch.tensor([0, 4, 2]), 2)
    with pytest.raises(LossInputError, match=r"cu_seqlens\[0\] must be 0"):
        pad_to_cp_multiple(torch.tensor([1, 4]), 2)
    with pytest.raises(LossInputError, match="integer"):
        pad_to_cp_multiple(torch.tensor([0.0, 4.0]), 2)
    with pytest.raises(ConfigError, match=r"cp_rank=2 outside \[0, cp_size=2\)"):
        split_for_cp(torch.zeros(7), c, 2, 2)
    with pytest.raises(ConfigError, match="cp_size must be >= 1"):
        pad_to_cp_multiple(c, 0)
    with pytest.raises(LossInputError, match=r"sequence 0 has length 5.*pad_to_cp_multiple"):
        cp_local_indices(c, 2, 0)
    with pytest.raises(LossInputError, match=r"pieces\[1\] must have 6 local tokens"):
        merge_cp_pieces([torch.zeros(6), torch.zeros(5)], c)
