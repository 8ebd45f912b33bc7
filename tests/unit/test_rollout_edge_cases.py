"""Issue 15 (finding 5): integer and boolean edge cases of the rollout contract, written into a
real JSONL file and read through the public readers. Each must end in `RolloutDataError` naming
the file line and field, never an OverflowError / ValueError traceback or a silent conversion."""

import json

import pytest

from unirl.core.data.rollout_io import read_rollouts
from unirl.core.errors import RolloutDataError
from unirl.rollouts import FileRolloutSource

GOOD = {"prompt_tokens": [1], "response_tokens": [2, 3], "reward": 1.0, "group_id": 0}

# (the bad line's JSON text, words the error must hold). Each is line 2 of the file.
CASES = [
    ('"reward": ' + "9" * 400, "field 'reward'"),  # an int past float's range: OverflowError
    ('"reward": ' + "9" * 5000, "not valid JSON"),  # past Python's 4300-digit str->int limit
    ('"group_id": ' + str(2**70), "field 'group_id'"),  # past int64: torch overflow
    ('"rollout_logprobs": [-1, -' + "9" * 400 + "]", "field 'rollout_logprobs' element 1"),
    ('"ref_logprobs": [true, -1.0]', "field 'ref_logprobs' element 0 is bool True"),
    ('"response_tokens": [true, 3]', "field 'response_tokens' element 0 is bool True"),
    ('"response_tokens": [3, false]', "field 'response_tokens' element 1 is bool False"),
    ('"reward": true', "field 'reward' is bool True"),
    ('"group_id": false', "field 'group_id' is bool False"),
    ('"values": [1, ' + "9" * 400 + "]", "field 'values' element 1"),
]


def _line(override: str) -> str:
    base = json.dumps(GOOD)[1:-1]  # the fields without braces; a later duplicate key wins
    return "{" + base + ", " + override + "}"


@pytest.mark.parametrize("override, words", CASES, ids=[c[1][:30] for c in CASES])
def test_edge_case_names_file_line_and_field(tmp_path, override, words):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + _line(override) + "\n")
    with pytest.raises(RolloutDataError) as info:
        read_rollouts(path)
    assert f"{path} line 2: " in str(info.value) and words in str(info.value)
    with pytest.raises(RolloutDataError) as info:
        FileRolloutSource(path, rollout_size=2).next_rollout(0)
    assert f"{path} line 2: " in str(info.value) and words in str(info.value)


def test_validation_errors_name_the_file_line(tmp_path):
    # a token outside the vocabulary is found by validate (it needs the model's vocab size):
    # the message names the line, not only "sample 1"
    path = tmp_path / "r.jsonl"
    bad = dict(GOOD, response_tokens=[2, 99])
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(bad) + "\n")
    for batch in (read_rollouts(path), FileRolloutSource(path, rollout_size=2).next_rollout(0)):
        with pytest.raises(RolloutDataError) as info:
            batch.validate(vocab_size=16, max_seq_len=8, samples_per_prompt=2)
        assert f"sample 1 ({path} line 3): field 'response_tokens' has token id 99" in str(
            info.value
        )


def test_huge_ints_in_memory_are_named_too():
    from unirl.core.data.rollout import RolloutSample

    with pytest.raises(RolloutDataError, match="field 'reward' is int of 16610 bits"):
        RolloutSample(prompt_tokens=[1], response_tokens=[2], reward=10**5000, group_id=0)
