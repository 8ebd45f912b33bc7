"""``routed_experts`` in the rollout data contract: conversion, validation against the sample's
lengths and the model's MoE shape, JSONL and Parquet files, and alignment through packing and
context-parallel splitting (checked by tokens that carry their own identity)."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
import torch

from unirl.core.data.microbatch import build_microbatch
from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.data.rollout_io import read_rollouts, write_rollouts
from unirl.core.data.routed_experts import (
    FREE,
    MoeShape,
    recorded_per_sample,
    select_moe_layers,
    unpack_routed_experts,
)
from unirl.core.errors import RolloutDataError

SHAPE = MoeShape(num_experts=6, top_k=2, moe_layers=(0, 2), norm_topk_prob=True)
VOCAB = 1000


def experts_for(n_rows: int, seed: int) -> list:
    """Valid experts: per token and layer, two distinct experts of six."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n_rows, 2, 6, generator=g).argsort(-1)[..., :2].tolist()


def sample(prompt: list[int], response: list[int], group: int = 0, experts=None, **kw):
    rows = len(prompt) + len(response) - 1
    return RolloutSample(
        prompt_tokens=prompt,
        response_tokens=response,
        reward=1.0,
        group_id=group,
        routed_experts=experts_for(rows, group) if experts is None else experts,
        **kw,
    )


def validate(batch: RolloutBatch, moe: MoeShape | None = SHAPE) -> None:
    batch.validate(vocab_size=VOCAB, max_seq_len=64, samples_per_prompt=1, moe=moe)


# -- conversion ----------------------------------------------------------------------------


def test_lists_arrays_and_tensors_become_int32_tensors():
    rows = experts_for(3, 0)
    for value in (rows, np.array(rows, dtype=np.int64), torch.tensor(rows, dtype=torch.int16)):
        s = sample([1, 2], [3, 4], experts=value)
        assert s.routed_experts.dtype == torch.int32
        assert s.routed_experts.tolist() == rows
    assert sample([1], [2], experts=[[[0, 1], [2, 3]]]).to_record()["routed_experts"] == [
        [[0, 1], [2, 3]]
    ]


@pytest.mark.parametrize(
    "value, message",
    [
        ([[0.5, 1.0]], r"non-integer entry"),
        ([[[0, 1]], [[2]]], r"ragged"),
        (torch.zeros(3, 2, dtype=torch.long), r"shape \(3, 2\), not 3 dimensions"),
        (torch.zeros(1, 2, 2), r"torch.float32 array"),
        ([[[True, False]]], r"non-integer entry"),
        ("0,1", r"is str"),
    ],
)
def test_bad_values_name_the_field(value, message):
    with pytest.raises(RolloutDataError, match=rf"field 'routed_experts' .*{message}"):
        sample([1], [2], experts=value)


# -- validation ----------------------------------------------------------------------------


def test_a_valid_batch_passes_with_and_without_the_model_shape():
    batch = RolloutBatch([sample([1, 2, 3], [4, 5], group=g) for g in range(2)])
    validate(batch)
    validate(batch, moe=None)
    assert batch.has("routed_experts")


def test_rows_must_be_every_token_but_the_last():
    bad = sample([1, 2], [3], experts=experts_for(3, 0))  # 2 + 1 tokens -> 2 rows
    with pytest.raises(
        RolloutDataError,
        match=r"sample 0: field 'routed_experts' has 3 rows but the sample has 2 prompt \+ 1 "
        r"response tokens, so 2 rows",
    ):
        validate(RolloutBatch([bad]), moe=None)


def test_layers_and_top_k_against_the_model():
    three_layers = [[[0, 1]] * 3] * 2
    with pytest.raises(
        RolloutDataError,
        match=r"shape \[2, 3, 2\] but the model has 2 MoE layers with top_k=2: give shape "
        r"\[2, 2, 2\]",
    ):
        validate(RolloutBatch([sample([1, 2], [3], experts=three_layers)]))


def test_expert_range_and_repeats_name_token_layer_and_slot():
    rows = experts_for(2, 0)
    rows[1][1][0] = 6
    with pytest.raises(
        RolloutDataError, match=r"expert 6 at token 1, MoE layer 1, slot 0, outside \[0, 6\)"
    ):
        validate(RolloutBatch([sample([1, 2], [3], experts=rows)]))
    rows = experts_for(2, 0)
    rows[0][0] = [4, 4]
    with pytest.raises(
        RolloutDataError, match=r"routes token 0 twice to one expert at MoE layer 0"
    ):
        validate(RolloutBatch([sample([1, 2], [3], experts=rows)]))
    rows[0][0] = [-1, 2]
    with pytest.raises(RolloutDataError, match=r"expert -1 at token 0"):
        validate(RolloutBatch([sample([1, 2], [3], experts=rows)]))


def test_replay_needs_the_field_on_every_sample():
    plain = RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=1)
    with pytest.raises(RolloutDataError, match=r"sample 0: field 'routed_experts' is missing but "):
        validate(
            RolloutBatch(
                [
                    RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=0),
                    plain,
                ]
            )
        )
    with pytest.raises(
        RolloutDataError, match=r"sample 1: field 'routed_experts' is missing but 1 other"
    ):
        validate(RolloutBatch([sample([1], [2], group=0), plain]))
    validate(RolloutBatch([plain]), moe=None)  # replay off: not needed


def test_file_errors_name_the_line_and_the_field(tmp_path):
    good = sample([1, 2], [3, 4], group=0)
    bad = sample([1, 2], [3, 4], group=1).to_record()
    bad["routed_experts"][2][0] = [0, 9]
    path = tmp_path / "r.jsonl"
    write_rollouts(path, [good])
    with open(path, "a") as f:
        f.write("\n" + json.dumps(bad) + "\n")
    batch = read_rollouts(path)
    assert torch.equal(batch[0].routed_experts, good.routed_experts)  # JSONL round trip
    with pytest.raises(
        RolloutDataError, match=rf"sample 1 \({path} line 3\): field 'routed_experts' has expert 9"
    ):
        validate(batch)


def test_parquet_rows_carry_routed_experts(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (Parquet is optional)")
    import pyarrow.parquet as pq

    from unirl.rollouts.source import FileRolloutSource

    samples = [sample([1, 2], [3, 4, 5], group=g) for g in range(2)]
    rows = [s.to_record() for s in samples]
    rows[1]["routed_experts"][3][1] = [2, 2]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    batch = FileRolloutSource(tmp_path / "r.parquet", rollout_size=2).next_rollout(0)
    assert torch.equal(batch[0].routed_experts, samples[0].routed_experts)
    with pytest.raises(
        RolloutDataError,
        match=r"sample 1 \(.*r.parquet row 2\): field 'routed_experts' routes token 3",
    ):
        validate(batch)


# -- packing and context parallel ------------------------------------------------------------


def identity_batch() -> RolloutBatch:
    """Every token id is unique, and every entry of a token's experts row is its own id: after any
    reordering, a position's experts must equal its token (or be FREE)."""
    lengths = [(3, 2), (1, 4), (2, 1), (4, 3)]
    samples, next_id = [], 1
    for g, (p, r) in enumerate(lengths):
        ids = list(range(next_id, next_id + p + r))
        next_id += p + r
        rows = [[[t, t]] * 2 for t in ids[:-1]]  # packing does not validate: ids as "experts"
        samples.append(sample(ids[:p], ids[p:], group=g, experts=rows))
    return RolloutBatch(samples)


def assert_follow_tokens(tokens: torch.Tensor, experts: torch.Tensor, lasts: set[int]) -> None:
    for pos, (tok, row) in enumerate(zip(tokens.tolist(), experts.tolist())):
        if tok == 0 or tok in lasts:  # CP padding (token 0) or a sequence's last token
            assert row == [[FREE, FREE]] * 2, (pos, tok, row)
        else:
            assert row == [[tok, tok]] * 2, (pos, tok, row)


def test_packing_moves_each_samples_experts_with_its_tokens():
    batch = identity_batch()
    lasts = {int(s.response_tokens[-1]) for s in batch.samples}
    packed = batch.pack([3, 0, 2])  # not batch order
    assert packed.routed_experts.shape == (packed.num_tokens, 2, 2)
    assert_follow_tokens(packed.tokens, packed.routed_experts, lasts)
    mb = build_microbatch(packed)  # logit-position alignment shifts targets, not inputs
    assert torch.equal(mb.routed_experts, packed.routed_experts)
    # the inverse gives each sample its rows back (what a recording forward returns)
    back = unpack_routed_experts(packed.routed_experts, packed.cu_seqlens)
    for i, rows in zip(packed.sample_indices, back):
        assert torch.equal(rows, batch[i].routed_experts)


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_split_keeps_experts_with_their_tokens(cp):
    batch = identity_batch()
    lasts = {int(s.response_tokens[-1]) for s in batch.samples}
    packed = batch.pack([1, 3, 0])
    seen = []
    for rank in range(cp):
        mb = build_microbatch(packed, cp_size=cp, cp_rank=rank)
        assert mb.routed_experts.shape == (mb.num_tokens, 2, 2)
        assert_follow_tokens(mb.tokens, mb.routed_experts, lasts)
        seen += [t for t in mb.tokens.tolist() if t]
    assert sorted(seen) == sorted(packed.tokens.tolist())  # every token on exactly one rank


def test_a_batch_without_experts_packs_none():
    plain = RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=0)
    packed = RolloutBatch([plain]).pack([0])
    assert packed.routed_experts is None
    assert build_microbatch(packed, cp_size=2, cp_rank=0).routed_experts is None


def test_recorded_experts_go_back_to_their_samples():
    """R2: a forward records [T, layers, top_k] per microbatch in packed order; the rows return
    to their samples (the identity trick: row entries are the token ids) and attach to the
    batch, which then packs them for training like a rollout's."""
    batch = identity_batch()
    plain = RolloutBatch(
        [attrs.evolve(s, routed_experts=None) for s in batch.samples], origins=None
    )
    packs = [plain.pack([2, 0]), plain.pack([]), plain.pack([1, 3])]
    recorded = []
    for p in packs:  # what a recording forward would return: each token's "experts"
        recorded.append(p.tokens[:, None, None].expand(-1, 2, 2).to(torch.int32))
    got = recorded_per_sample(packs, recorded)
    assert sorted(got) == [0, 1, 2, 3]
    attached = plain.with_routed_experts(got)
    for s, want in zip(attached.samples, batch.samples):
        assert torch.equal(s.routed_experts, want.routed_experts)
    with pytest.raises(RolloutDataError, match=r"no recorded experts for samples \[1, 3\]"):
        plain.with_routed_experts({0: got[0], 2: got[2]})
    with pytest.raises(RolloutDataError, match=r"recorded routing has 3 rows for a microbatch"):
        recorded_per_sample(packs[:1], [recorded[0][:3]])


def test_an_engines_all_layer_array_is_cut_to_the_moe_layers():
    # vLLM's layout: one column per decoder layer (layer 1 dense, never written: zeros), uint8
    n, k = 4, 2
    all_layers = np.zeros((n, 3, k), dtype=np.uint8)
    all_layers[:, 0] = [[0, 1], [2, 3], [4, 5], [1, 2]]
    all_layers[:, 2] = [[5, 4], [3, 2], [1, 0], [0, 3]]
    got = select_moe_layers(all_layers, SHAPE)  # SHAPE.moe_layers == (0, 2)
    assert got.tolist() == [[list(all_layers[t, 0]), list(all_layers[t, 2])] for t in range(n)]
    assert select_moe_layers(got, SHAPE).tolist() == got.tolist()  # already per MoE layer
    with pytest.raises(RolloutDataError, match=r"has 1 layers, neither the model's 2 MoE layers"):
        select_moe_layers(np.zeros((n, 1, k), dtype=np.int64), SHAPE)
