"""The rollout data contract: every validation error from a real malformed batch, the tensor
views and packing against hand-written layouts, and the JSONL round trip."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.data.rollout_io import read_rollouts, write_rollouts
from unirl.core.errors import RolloutDataError

VOCAB, MAX_LEN, PER_PROMPT = 32, 8, 2


def good_records() -> list[dict]:
    return [
        {
            "prompt_tokens": [1, 2],
            "response_tokens": [3, 4, 5],
            "reward": 1.0,
            "group_id": 0,
            "loss_mask": [1, 1, 0],
            "rollout_logprobs": [-0.5, -1.0, -0.25],
            "ref_logprobs": [-0.75, -1.5, -0.125],
            "values": [0.5, 0.25, 2.0],
            "metadata": {"source": "gsm8k", "id": 7},
        },
        {
            "prompt_tokens": [1, 2],
            "response_tokens": [6, 7],
            "reward": 0.0,
            "group_id": 0,
            "loss_mask": [1, 1],
            "rollout_logprobs": [-0.125, -2.0],
            "ref_logprobs": [-0.25, -2.5],
            "values": [1.0, -1.0],
        },
        {
            "prompt_tokens": [9],
            "response_tokens": [10, 11, 12, 13],
            "reward": 0.5,
            "group_id": 1,
            "rollout_logprobs": [-1.0, -1.0, -0.5, 0.0],
            "ref_logprobs": [-1.0, -0.5, -0.5, -0.0],
            "values": [0.0, 0.0, 0.0, 0.0],
        },
        {
            "prompt_tokens": [9],
            "response_tokens": [14, 31, 2],
            "reward": -1.0,
            "group_id": 1,
            "loss_mask": [0, 1, 1],
            "rollout_logprobs": [-3.0, -0.5, -0.25],
            "ref_logprobs": [-2.0, -0.5, -0.5],
            "values": [3.0, 2.0, 1.0],
        },
    ]


def validate(records: list[dict]) -> None:
    RolloutBatch.from_records(records).validate(
        vocab_size=VOCAB, max_seq_len=MAX_LEN, samples_per_prompt=PER_PROMPT
    )


_DELETE = object()  # corrupt(i, field=_DELETE) removes the field


def corrupt(index: int, **fields) -> list[dict]:
    """The good records with fields of sample ``index`` replaced (or removed)."""
    records = copy.deepcopy(good_records())
    for name, value in fields.items():
        if value is _DELETE:
            del records[index][name]
        else:
            records[index][name] = value
    return records


def test_good_batch_passes() -> None:
    validate(good_records())


# (case id, records, sample index, field, words the message must also contain)
CORRUPTIONS = [
    (
        "mask-short",
        corrupt(3, loss_mask=[0, 1]),
        3,
        "loss_mask",
        "has 2 values but 'response_tokens' has 3",
    ),
    (
        "rollout-lp-short",
        corrupt(0, rollout_logprobs=[-0.5, -1.0]),
        0,
        "rollout_logprobs",
        "has 2 values but 'response_tokens' has 3; give one log-prob per response token",
    ),
    ("ref-lp-long", corrupt(2, ref_logprobs=[-1.0] * 5), 2, "ref_logprobs", "has 5 values"),
    (
        "values-short",
        corrupt(1, values=[1.0]),
        1,
        "values",
        "one value estimate per response token",
    ),
    (
        "empty-response",
        corrupt(
            1, response_tokens=[], loss_mask=[], rollout_logprobs=[], ref_logprobs=[], values=[]
        ),
        1,
        "response_tokens",
        "is empty",
    ),
    ("empty-prompt", corrupt(2, prompt_tokens=[]), 2, "prompt_tokens", "is empty"),
    (
        "token-too-big",
        corrupt(3, response_tokens=[14, 32, 2]),
        3,
        "response_tokens",
        "token id 32 at position 1, outside the vocabulary [0, 32)",
    ),
    ("token-negative", corrupt(0, prompt_tokens=[1, -1]), 0, "prompt_tokens", "token id -1"),
    # 2 prompt + 7 response = 9 > 8
    (
        "too-long",
        corrupt(
            1,
            response_tokens=[6] * 7,
            loss_mask=_DELETE,
            rollout_logprobs=[-1.0] * 7,
            ref_logprobs=[-1.0] * 7,
            values=[0.0] * 7,
        ),
        1,
        "prompt (2) + response (7) = 9",
        "max_seq_len=8",
    ),
    ("reward-nan", corrupt(2, reward=float("nan")), 2, "reward", "nan"),
    ("reward-inf", corrupt(0, reward=float("inf")), 0, "reward", "finite"),
    (
        "rollout-lp-nan",
        corrupt(1, rollout_logprobs=[-0.1, float("nan")]),
        1,
        "rollout_logprobs",
        "position 1",
    ),
    (
        "ref-lp-neg-inf",
        corrupt(3, ref_logprobs=[-2.0, -math.inf, -0.5]),
        3,
        "ref_logprobs",
        "-inf at position 1",
    ),
    (
        "rollout-lp-positive",
        corrupt(2, rollout_logprobs=[-1.0, 0.5, -0.5, 0.0]),
        2,
        "rollout_logprobs",
        "0.5 at position 1, above 0",
    ),
    (
        "ref-lp-probability",
        corrupt(0, ref_logprobs=[0.9, 0.1, 0.2]),
        0,
        "ref_logprobs",
        "not probabilities",
    ),
    ("values-nan", corrupt(3, values=[1.0, float("nan"), 1.0]), 3, "values", "finite"),
    # group 0 keeps sample 0 only; sample 1 moves to a new group 5 of one sample
    ("group-size", corrupt(1, group_id=5), 0, "group_id", "shared by 1 samples (0)"),
    ("optional-missing", corrupt(2, values=_DELETE), 2, "values", "missing but 3 other samples"),
]


@pytest.mark.parametrize(
    ("records", "index", "field", "words"),
    [pytest.param(r, i, f, w, id=name) for name, r, i, f, w in CORRUPTIONS],
)
def test_each_corruption_is_named(records, index, field, words) -> None:
    with pytest.raises(RolloutDataError) as info:
        validate(records)
    message = str(info.value)
    assert f"sample {index}:" in message
    assert field in message
    assert words in message


def test_group_size_error_names_every_short_group() -> None:
    # groups: 0 -> [0], 5 -> [1], 1 -> [2, 3]: two groups of one sample, each named
    with pytest.raises(RolloutDataError) as info:
        validate(corrupt(1, group_id=5))
    message = str(info.value)
    assert "2 problems" in message
    assert "sample 0: field 'group_id' = 0" in message
    assert "sample 1: field 'group_id' = 5" in message
    assert "samples_per_prompt is 2" in message


def test_all_zero_loss_mask_over_batch() -> None:
    records = good_records()
    for r in records:
        r["loss_mask"] = [0] * len(r["response_tokens"])
    with pytest.raises(RolloutDataError, match=r"field 'loss_mask' is zero .* all 4 samples"):
        validate(records)


def test_zero_mask_on_one_sample_is_fine() -> None:
    validate(corrupt(1, loss_mask=[0, 0]))


def test_tiny_positive_logprob_is_rounding_not_an_error() -> None:
    # 5e-7 is below the 1e-6 tolerance: a log-softmax of a probability-1 token rounded up
    validate(corrupt(2, rollout_logprobs=[-1.0, 5e-7, -0.5, 0.0]))


def test_all_problems_listed_together() -> None:
    records = corrupt(0, reward=float("nan"))
    records[3]["response_tokens"] = [14, 99, 2]
    with pytest.raises(RolloutDataError) as info:
        validate(records)
    message = str(info.value)
    assert "2 problems" in message
    assert "sample 0: field 'reward'" in message
    assert "sample 3: field 'response_tokens' has token id 99" in message


def test_empty_batch_and_bad_validate_arguments() -> None:
    with pytest.raises(RolloutDataError, match="no samples"):
        RolloutBatch(()).validate(vocab_size=VOCAB, max_seq_len=MAX_LEN, samples_per_prompt=1)
    with pytest.raises(RolloutDataError, match="vocab_size"):
        RolloutBatch.from_records(good_records()).validate(
            vocab_size=0, max_seq_len=MAX_LEN, samples_per_prompt=PER_PROMPT
        )


# -- from_records: types, missing and unknown fields ---------------------------------------


@pytest.mark.parametrize(
    ("records", "words"),
    [
        pytest.param(
            corrupt(2, group_id=_DELETE),
            "sample 2: missing required field 'group_id'",
            id="missing",
        ),
        pytest.param(
            corrupt(1, rewards=1.0),
            "sample 1: unknown field 'rewards'; did you mean 'reward'?",
            id="unknown",
        ),
        pytest.param(
            corrupt(3, reward="high"), "sample 3: field 'reward' is str 'high'", id="reward-str"
        ),
        pytest.param(corrupt(0, reward=True), "sample 0: field 'reward' is bool", id="reward-bool"),
        pytest.param(
            corrupt(1, group_id=1.5), "sample 1: field 'group_id' is float 1.5", id="group-float"
        ),
        pytest.param(
            corrupt(2, response_tokens=[10, 11.5, 12, 13]),
            "sample 2: field 'response_tokens' element 1 is float 11.5",
            id="token-float",
        ),
        pytest.param(
            corrupt(0, prompt_tokens="1 2"),
            "sample 0: field 'prompt_tokens' is str",
            id="tokens-str",
        ),
        pytest.param(
            corrupt(3, loss_mask=[0, 2, 1]),
            "sample 3: field 'loss_mask' element 1 is int 2",
            id="mask-two",
        ),
        pytest.param(
            corrupt(1, ref_logprobs=[-0.1, "x"]),
            "sample 1: field 'ref_logprobs' element 1 is str 'x'",
            id="logprob-str",
        ),
        pytest.param(corrupt(0, metadata=[1]), "sample 0: field 'metadata' is list", id="metadata"),
        pytest.param([*good_records()[:2], [1, 2]], "sample 2: record is list", id="not-a-dict"),
    ],
)
def test_from_records_names_sample_and_field(records, words) -> None:
    with pytest.raises(RolloutDataError) as info:
        RolloutBatch.from_records(records)
    assert words in str(info.value)


def test_tensor_and_numpy_inputs_are_normalised() -> None:
    sample = RolloutSample(
        prompt_tokens=torch.tensor([1, 2], dtype=torch.int32),
        response_tokens=np.array([3, 4]),
        reward=torch.tensor(0.5),
        group_id=np.int64(3),
        rollout_logprobs=torch.tensor([-0.5, -0.25], dtype=torch.float64),
        loss_mask=torch.tensor([1, 0]),
    )
    assert sample.prompt_tokens.dtype == torch.long and sample.response_tokens.dtype == torch.long
    assert sample.response_tokens.tolist() == [3, 4]
    assert sample.reward == 0.5 and isinstance(sample.reward, float)
    assert sample.group_id == 3 and isinstance(sample.group_id, int)
    assert sample.rollout_logprobs.dtype == torch.float32
    assert sample.loss_mask.tolist() == [True, False]
    # no loss mask given: every response token is trained on
    plain = RolloutSample(prompt_tokens=[1], response_tokens=[2, 3, 4], reward=0, group_id=0)
    assert plain.loss_mask.tolist() == [True, True, True]
    with pytest.raises(
        RolloutDataError, match=r"field 'response_tokens' is a tensor of shape \(1, 2\)"
    ):
        RolloutSample(
            prompt_tokens=[1], response_tokens=torch.tensor([[2, 3]]), reward=0, group_id=0
        )
    with pytest.raises(RolloutDataError, match=r"field 'prompt_tokens' is a torch\.float32 tensor"):
        RolloutSample(prompt_tokens=torch.tensor([1.0]), response_tokens=[2], reward=0, group_id=0)


# -- views and packing ---------------------------------------------------------------------


def test_tensor_views() -> None:
    batch = RolloutBatch.from_records(good_records())
    assert batch.prompt_lengths.tolist() == [2, 2, 1, 1]
    assert batch.response_lengths.tolist() == [3, 2, 4, 3]
    assert batch.lengths.tolist() == [5, 4, 5, 4]
    # masks: [1,1,0] -> 2, [1,1] -> 2, default all ones -> 4, [0,1,1] -> 2
    assert batch.valid_token_counts.tolist() == [2, 2, 4, 2]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5, -1.0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.has("rollout_logprobs") and batch.has("values")
    assert not RolloutBatch.from_records(corrupt(0, values=_DELETE)).has("values")


def test_padded_responses() -> None:
    batch = RolloutBatch.from_records(good_records())
    padded = batch.padded_responses()
    assert padded.tokens.tolist() == [[3, 4, 5, 0], [6, 7, 0, 0], [10, 11, 12, 13], [14, 31, 2, 0]]
    assert padded.mask.tolist() == [
        [True, True, True, False],
        [True, True, False, False],
        [True, True, True, True],
        [True, True, True, False],
    ]
    assert padded.loss_mask.tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, True, True, True],
        [False, True, True, False],
    ]
    assert padded.lengths.tolist() == [3, 2, 4, 3]
    assert padded.rollout_logprobs[1].tolist() == [-0.125, -2.0, 0.0, 0.0]
    assert padded.values[3].tolist() == [3.0, 2.0, 1.0, 0.0]


def test_pack_hand_written_layout() -> None:
    batch = RolloutBatch.from_records(good_records())
    mb = batch.pack([3, 0])
    # sample 3: prompt [9] response [14, 31, 2]; sample 0: prompt [1, 2] response [3, 4, 5]
    assert mb.sample_indices == (3, 0)
    assert mb.tokens.tolist() == [9, 14, 31, 2, 1, 2, 3, 4, 5]
    assert mb.cu_seqlens.tolist() == [0, 4, 9] and mb.cu_seqlens.dtype == torch.int32
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert mb.seq_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert mb.response_mask.tolist() == [0, 1, 1, 1, 0, 0, 1, 1, 1]
    # sample 3 mask [0, 1, 1]; sample 0 mask [1, 1, 0]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0]
    assert mb.rollout_logprobs.tolist() == [0, -3.0, -0.5, -0.25, 0, 0, -0.5, -1.0, -0.25]
    assert mb.ref_logprobs.tolist() == [0, -2.0, -0.5, -0.5, 0, 0, -0.75, -1.5, -0.125]
    assert mb.values.tolist() == [0, 3.0, 2.0, 1.0, 0, 0, 0.5, 0.25, 2.0]
    assert mb.response_index.tolist() == [1, 2, 3, 6, 7, 8]
    assert mb.prompt_lengths.tolist() == [1, 2] and mb.response_lengths.tolist() == [3, 3]
    assert mb.num_tokens == 9 and mb.max_seqlen == 5


def test_place_responses_matches_per_sample_loop() -> None:
    batch = RolloutBatch.from_records(good_records())
    advantages = torch.arange(16, dtype=torch.float64).reshape(4, 4) + 100.0
    mb = batch.pack([2, 1, 3])
    placed = mb.place_responses(advantages, fill=-1.0)
    expected = []
    for i in (2, 1, 3):  # per sample: fill at prompt positions, then its response row
        expected += [-1.0] * batch[i].prompt_length
        expected += advantages[i, : batch[i].response_length].tolist()
    assert placed.tolist() == expected
    assert placed.dtype == torch.float64
    with pytest.raises(RolloutDataError, match="L >= the longest response"):
        mb.place_responses(advantages[:, :2])


def test_responses_from_logits_reads_the_position_before_each_response_token() -> None:
    batch = RolloutBatch.from_records(good_records())
    mb = batch.pack([3, 0])
    # tokens [9, 14, 31, 2 | 1, 2, 3, 4, 5]; responses at 1-3 and 6-8, predicted by the
    # logits at 0-2 and 5-7 (value = 10 x position here)
    values = torch.arange(9, dtype=torch.float32) * 10
    got = mb.responses_from_logits(values)
    assert [g.tolist() for g in got] == [[0.0, 10.0, 20.0], [50.0, 60.0, 70.0]]


def test_pack_without_optional_fields_and_empty() -> None:
    records = [
        {k: r[k] for k in ("prompt_tokens", "response_tokens", "reward", "group_id")}
        for r in good_records()
    ]
    batch = RolloutBatch.from_records(records)
    mb = batch.pack([1])
    assert mb.rollout_logprobs is None and mb.ref_logprobs is None and mb.values is None
    assert mb.loss_mask.tolist() == [False, False, True, True]
    empty = batch.pack([])
    assert empty.num_tokens == 0 and empty.cu_seqlens.tolist() == [0] and empty.max_seqlen == 0


# -- JSONL ---------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path) -> None:
    batch = RolloutBatch.from_records(good_records())
    path = tmp_path / "rollouts.jsonl"
    write_rollouts(path, batch)
    assert len(path.read_text().splitlines()) == 4
    back = read_rollouts(path)
    assert back == batch
    assert back[0].metadata == {"source": "gsm8k", "id": 7}
    assert back[2].loss_mask.tolist() == [True] * 4
    back.validate(vocab_size=VOCAB, max_seq_len=MAX_LEN, samples_per_prompt=PER_PROMPT)
    # a value changed after the round trip is not equal: the comparison can fail
    assert back != RolloutBatch.from_records(corrupt(3, reward=-2.0))


def test_jsonl_errors_name_the_line(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = [
        '{"prompt_tokens": [1], "response_tokens": [2], "reward": 1, "group_id": 0}',
        "",
        '{"prompt_tokens": [1], "response_tokens": [2], "reward": "1", "group_id": 0}',
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(RolloutDataError, match=r"bad.jsonl line 3: field 'reward' is str"):
        read_rollouts(path)
    path.write_text(lines[0] + "\n" + '{"prompt_tokens": [1], "response_tokens": [2,\n')
    with pytest.raises(RolloutDataError, match=r"bad.jsonl line 2: not valid JSON"):
        read_rollouts(path)
    path.write_text(lines[0] + "\n" + '{"prompt_tokens": [1], "reward": 1, "group_id": 0}\n')
    with pytest.raises(RolloutDataError, match=r"line 2: missing required field 'response_tokens'"):
        read_rollouts(path)


def test_jsonl_metadata_that_is_not_json(tmp_path) -> None:
    sample = RolloutSample(
        prompt_tokens=[1], response_tokens=[2], reward=0.0, group_id=0, metadata={"x": {1, 2}}
    )
    with pytest.raises(RolloutDataError, match="sample 0: field 'metadata'"):
        write_rollouts(tmp_path / "m.jsonl", [sample])
