"""The tensor layouts of the HF <-> Megatron conversion against hand-written small tensors."""

import pytest
import torch

from unirl.backends.megatron.weights.hf_layout import (
    deinterleave_qkv,
    fuse_gate_up,
    interleave_qkv,
    pad_vocab,
    padded_vocab_size,
    shard_qkv,
    unfuse_gate_up,
)
from unirl.core.errors import ConfigError


def test_padded_vocab_size():
    assert padded_vocab_size(100, 1) == 128  # next multiple of 128
    assert padded_vocab_size(100, 2) == 256  # multiple of 128 * 2
    assert padded_vocab_size(128, 1) == 128  # already a multiple: unchanged
    assert padded_vocab_size(129, 1) == 256
    assert padded_vocab_size(256, 2) == 256
    assert padded_vocab_size(257, 2) == 512
    # Qwen2.5: 151936 = 593.5 * 256 -> 594 * 256 = 152064 at tp=2; 151936 = 1187 * 128 at tp=1
    assert padded_vocab_size(151936, 2) == 152064
    assert padded_vocab_size(151936, 1) == 151936
    assert padded_vocab_size(100, 4, divisible_by=1) == 100  # 100 = 25 * 4
    assert padded_vocab_size(101, 4, divisible_by=1) == 104
    with pytest.raises(ConfigError, match="vocab_size=0"):
        padded_vocab_size(0, 1)


# 4 query heads, 2 key/value groups, head_dim 1: heads 0,1 use group 0 and heads 2,3 group 1
Q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
K = torch.tensor([[20.0], [21.0]])
V = torch.tensor([[30.0], [31.0]])
# per group: its query heads, its key, its value
FUSED = torch.tensor([[10.0], [11.0], [20.0], [30.0], [12.0], [13.0], [21.0], [31.0]])


def test_interleave_qkv_per_query_group():
    assert torch.equal(interleave_qkv(Q, K, V, num_query_groups=2), FUSED)
    q, k, v = deinterleave_qkv(FUSED, num_heads=4, num_query_groups=2, head_dim=1)
    assert torch.equal(q, Q) and torch.equal(k, K) and torch.equal(v, V)


def test_interleave_qkv_head_dim_2_bias_and_one_group():
    # head_dim 2, 2 heads, 1 group (MQA); 1-D like a bias: rows are [q0 q0' q1 q1' k k' v v']
    q = torch.tensor([1.0, 2.0, 3.0, 4.0])
    k = torch.tensor([5.0, 6.0])
    v = torch.tensor([7.0, 8.0])
    fused = interleave_qkv(q, k, v, num_query_groups=1)
    assert torch.equal(fused, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]))
    # 2 heads, 2 groups (MHA), head_dim 2: [q0 q0' k0 k0' v0 v0' | q1 q1' k1 k1' v1 v1']
    fused = interleave_qkv(
        q,
        torch.tensor([5.0, 6.0, 9.0, 10.0]),
        torch.tensor([7.0, 8.0, 11.0, 12.0]),
        num_query_groups=2,
    )
    expected = [1.0, 2.0, 5.0, 6.0, 7.0, 8.0, 3.0, 4.0, 9.0, 10.0, 11.0, 12.0]
    assert torch.equal(fused, torch.tensor(expected))
    back = deinterleave_qkv(fused, num_heads=2, num_query_groups=2, head_dim=2)
    assert [t.tolist() for t in back] == [
        [1.0, 2.0, 3.0, 4.0],
        [5.0, 6.0, 9.0, 10.0],
        [7.0, 8.0, 11.0, 12.0],
    ]


def test_qkv_tp_shards_hold_whole_groups():
    # tp=2: rank 0 gets group 0 (heads 0,1 + k0 + v0), rank 1 group 1
    r0 = shard_qkv(Q, K, V, num_query_groups=2, tp_size=2, tp_rank=0)
    r1 = shard_qkv(Q, K, V, num_query_groups=2, tp_size=2, tp_rank=1)
    assert r0.flatten().tolist() == [10.0, 11.0, 20.0, 30.0]
    assert r1.flatten().tolist() == [12.0, 13.0, 21.0, 31.0]
    # a weight with 3 input columns keeps its columns
    w = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    q, k, v = w[:4], w[4:6], w[6:]
    r1 = shard_qkv(q, k, v, num_query_groups=2, tp_size=2, tp_rank=1)
    assert torch.equal(r1, torch.stack([w[2], w[3], w[5], w[7]]))


def test_fc1_fuses_gate_and_up_per_tp_block():
    gate = torch.tensor([[1.0], [2.0], [3.0], [4.0]])
    up = torch.tensor([[5.0], [6.0], [7.0], [8.0]])
    # tp=1: [gate; up]
    assert fuse_gate_up(gate, up, tp_size=1, tp_rank=0).flatten().tolist() == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
    ]
    # tp=2: rank r holds [gate rows of block r; up rows of block r]
    r0 = fuse_gate_up(gate, up, tp_size=2, tp_rank=0)
    r1 = fuse_gate_up(gate, up, tp_size=2, tp_rank=1)
    assert r0.flatten().tolist() == [1.0, 2.0, 5.0, 6.0]
    assert r1.flatten().tolist() == [3.0, 4.0, 7.0, 8.0]
    g, u = unfuse_gate_up([r0, r1])
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_pad_vocab_appends_zero_rows():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    padded = pad_vocab(w, 4)
    assert padded.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [0.0, 0.0]]
    assert pad_vocab(w, 3) is w
