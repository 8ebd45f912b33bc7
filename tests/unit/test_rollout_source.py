"""Rollout sources: the file reader (chunking, errors, resume) and the sampler source (groups,
rewards, resume) built from a config."""

import io
import json
import logging

import pytest
import torch

from tests.tiny_models import TINY_LLAMA
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import (
    FileRolloutSource,
    RolloutSource,
    SamplerRolloutSource,
    build_rollout_source,
    hf_config_for_tokenizer,
    write_task_rollouts,
)
from unirl.rollouts.data.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


TINY = dict(TINY_LLAMA)


def make_cfg(rollout=None, model=None, prompts=3, samples=4, seed=3):
    return config_from_dict(
        {
            "backend": "deepspeed",
            "model": {"hf_config": dict(TINY), "max_seq_len": 32, "init_seed": 1, **(model or {})},
            "batch": {
                "prompts_per_rollout": prompts,
                "samples_per_prompt": samples,
                "samples_per_optimizer_step": prompts * samples,
                "micro_batch_size": prompts * samples,
            },
            "parallel": {"world_size": 1},
            "rollout": {"task": "reverse_digits", "max_new_tokens": 6, **(rollout or {})},
            "train": {"seed": seed},
        }
    )


def record(i: int) -> dict:
    # Sample i: prompt [1, i], response [4 + i % 10, 2], reward i / 10, group i // 2.
    return {
        "prompt_tokens": [1, i],
        "response_tokens": [4 + i % 10, 2],
        "reward": i / 10,
        "group_id": i // 2,
    }


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# -- file source ----------------------------------------------------------------------------


def test_file_source_chunks_in_file_order(tmp_path, caplog):
    # 10 records with blank lines between: rollouts of 4 -> 2 rollouts, 2 samples left over.
    lines = []
    for i in range(10):
        lines.append(json.dumps(record(i)))
        if i in (1, 5):
            lines.append("")
    path = write_jsonl(tmp_path / "r.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        source = FileRolloutSource(path, rollout_size=4)
    # Records 8 and 9 sit on lines 11 and 12 (two blank lines before them).
    assert "2 samples from line 11 on do not fill a rollout of 4" in caplog.text
    assert isinstance(source, RolloutSource)
    assert source.num_rollouts == 2 and source.vocab_size is None
    first, second = source.next_rollout(0), source.next_rollout(1)
    assert [s.prompt_tokens.tolist() for s in first.samples] == [[1, i] for i in range(4)]
    assert [s.prompt_tokens.tolist() for s in second.samples] == [[1, i] for i in range(4, 8)]
    assert [s.reward for s in second.samples] == pytest.approx([0.4, 0.5, 0.6, 0.7])
    assert [s.group_id for s in second.samples] == [2, 2, 3, 3]
    source.sync_weights(as_buckets({}), policy_version=3)  # a no-op for files
    with pytest.raises(RolloutDataError) as err:
        source.next_rollout(2)
    msg = str(err.value)
    assert str(path) in msg and "line 12" in msg and "holds 2 rollouts of 4 samples" in msg
    assert "train.rl_steps" in msg


def test_file_source_with_fewer_samples_than_a_rollout(tmp_path):
    path = write_jsonl(tmp_path / "short.jsonl", [json.dumps(record(i)) for i in range(3)])
    with pytest.raises(RolloutDataError) as err:
        FileRolloutSource(path, rollout_size=4)
    msg = str(err.value)
    assert f"{path} line 3" in msg and "3 samples" in msg and "holds 0 rollouts" in msg
    assert "batch.prompts_per_rollout x batch.samples_per_prompt" in msg
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", ""])
    with pytest.raises(RolloutDataError, match=r"after 0 samples"):
        FileRolloutSource(empty, rollout_size=1)
    with pytest.raises(ConfigError, match=r"rollout.file=.*does not exist"):
        FileRolloutSource(tmp_path / "missing.jsonl", rollout_size=1)


def test_file_source_bad_record_names_file_and_line(tmp_path):
    lines = [json.dumps(record(i)) for i in range(4)]
    bad = record(4)
    bad["reward"] = "high"
    lines += [json.dumps(bad), "{not json", json.dumps(record(6)), json.dumps(record(7))]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    source = FileRolloutSource(path, rollout_size=4)
    source.next_rollout(0)  # the first rollout is fine
    with pytest.raises(RolloutDataError, match=rf"{path} line 5: field 'reward' is str 'high'"):
        source.next_rollout(1)


def test_file_source_state_dict_resumes_at_the_next_rollout(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [json.dumps(record(i)) for i in range(12)])
    source = FileRolloutSource(path, rollout_size=4)
    source.next_rollout(0)
    state = json.loads(json.dumps(source.state_dict()))  # survives JSON
    resumed = FileRolloutSource(path, rollout_size=4)
    resumed.load_state_dict(state)
    batch = resumed.next_rollout(1)
    assert [s.prompt_tokens.tolist()[1] for s in batch.samples] == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"rollouts of 4 samples, this config asks for 6"):
        FileRolloutSource(path, rollout_size=6).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"from source 'file', but rollout.source is 'sampler'"):
        build_rollout_source(make_cfg()).load_state_dict(state)


def test_parquet_file_source(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (Parquet is optional)")
    import pyarrow.parquet as pq

    rows = [record(i) for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    source = FileRolloutSource(tmp_path / "r.parquet", rollout_size=3)
    assert source.num_rollouts == 2
    source.next_rollout(0)
    batch = source.next_rollout(1)
    assert [s.prompt_tokens.tolist() for s in batch.samples] == [[1, 3], [1, 4], [1, 5]]
    assert [s.reward for s in batch.samples] == pytest.approx([0.3, 0.4, 0.5])
    with pytest.raises(RolloutDataError, match=r"r.parquet row 6: the file ends"):
        source.next_rollout(2)


def test_build_file_source_from_config(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [json.dumps(record(i)) for i in range(25)])
    cfg = make_cfg(rollout={"source": "file", "file": str(path)}, prompts=2, samples=6)
    source = build_rollout_source(cfg)
    assert isinstance(source, FileRolloutSource)
    assert source.num_rollouts == 2  # 25 // (2 x 6)
    assert len(source.next_rollout(0)) == 12


# -- sampler source -------------------------------------------------------------------------


def reverse_reward(prompt_ids, response_ids):
    """The reward of reverse_digits, written out again: compare the response, cut after its
    first <eos> (id 2), position by position with reversed(prompt digits) + <eos>."""
    target = [*reversed(prompt_ids[1:-1]), 2]
    response = list(response_ids)
    if 2 in response:
        response = response[: response.index(2) + 1]
    return sum(1 for j, t in enumerate(target) if j < len(response) and response[j] == t) / len(
        target
    )


def test_sampler_source_groups_rewards_and_contract():
    cfg = make_cfg(prompts=3, samples=4)
    source = build_rollout_source(cfg)
    assert isinstance(source, SamplerRolloutSource) and isinstance(source, RolloutSource)
    assert source.num_rollouts is None
    assert source.vocab_size == 14  # vocab_size left out of hf_config: the tokenizer's
    for step in range(2):
        batch = source.next_rollout(step)
        batch.validate(vocab_size=14, max_seq_len=32, samples_per_prompt=4)
        assert len(batch) == 12 and batch.has("rollout_logprobs")
        for i, s in enumerate(batch.samples):
            group = i // 4
            # Contiguous groups of 4 with one prompt, ids unique over the run.
            assert s.group_id == step * 3 + group
            assert torch.equal(s.prompt_tokens, batch.samples[group * 4].prompt_tokens)
            assert s.reward == pytest.approx(
                reverse_reward(s.prompt_tokens.tolist(), s.response_tokens.tolist()), abs=1e-12
            )
            assert 0.0 <= s.reward <= 1.0
            assert s.metadata["task"] == "reverse_digits" and s.metadata["rl_step"] == step
            assert s.response_length <= 6
        prompts = {tuple(batch.samples[g * 4].prompt_tokens.tolist()) for g in range(3)}
        assert len(prompts) > 1  # different prompts across groups


def test_sampler_source_is_seeded_and_resumes():
    cfg = make_cfg()
    a, b = build_rollout_source(cfg), build_rollout_source(cfg)
    other = build_rollout_source(make_cfg(seed=4))

    def key(batch):
        return [(s.prompt_tokens.tolist(), s.response_tokens.tolist()) for s in batch.samples]

    first_a, first_b = a.next_rollout(0), b.next_rollout(0)
    assert key(first_a) == key(first_b)
    assert key(other.next_rollout(0)) != key(first_a)
    # Save after one rollout (through torch.save, as a checkpoint would), continue elsewhere.
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    expected = a.next_rollout(1)
    resumed = build_rollout_source(cfg)
    resumed.load_state_dict(state)
    got = resumed.next_rollout(1)
    assert key(got) == key(expected)
    assert [s.group_id for s in got.samples] == [s.group_id for s in expected.samples]
    for x, y in zip(got.samples, expected.samples):
        assert torch.equal(x.rollout_logprobs, y.rollout_logprobs)
    with pytest.raises(ConfigError, match=r"sampled task 'reverse_digits'.*'add_small'"):
        build_rollout_source(make_cfg(rollout={"task": "add_small"})).load_state_dict(state)


def test_sampler_source_follows_synced_weights():
    cfg = make_cfg()
    source = build_rollout_source(cfg)
    # The policy after "training": another init of the same architecture.
    policy = build_rollout_source(make_cfg(model={"init_seed": 2})).sampler.model
    assert {s.policy_version for s in source.next_rollout(0).samples} == {0}  # the init
    source.sync_weights(as_buckets(policy.state_dict()), policy_version=5)
    batch = source.next_rollout(1)
    assert {s.policy_version for s in batch.samples} == {5}  # the synced weights' version
    for s in batch.samples:
        full = torch.cat([s.prompt_tokens, s.response_tokens])[None]
        with torch.no_grad():
            logp = torch.log_softmax(policy(input_ids=full).logits[0].float(), dim=-1)
        p = s.prompt_length
        ref = torch.stack([logp[p - 1 + j, t] for j, t in enumerate(s.response_tokens.tolist())])
        torch.testing.assert_close(s.rollout_logprobs, ref, atol=1e-5, rtol=0)


def test_model_config_must_fit_the_task():
    tok = CharTokenizer("0123456789")
    filled = hf_config_for_tokenizer({"model_type": "llama"}, tok)
    assert filled["vocab_size"] == 14 and filled["eos_token_id"] == 2
    assert hf_config_for_tokenizer({"vocab_size": 32}, tok)["vocab_size"] == 32
    with pytest.raises(ConfigError, match=r"model.hf_config.vocab_size=10 is smaller .* 14"):
        build_rollout_source(make_cfg(model={"hf_config": {**TINY, "vocab_size": 10}}))
    with pytest.raises(ConfigError, match=r"model.hf_config.eos_token_id=5"):
        hf_config_for_tokenizer({"eos_token_id": 5}, tok)
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=4 is shorter .* \(5 tokens"):
        build_rollout_source(make_cfg(rollout={"max_new_tokens": 4}))
    with pytest.raises(ConfigError, match=r"exceed model.max_seq_len=10; raise model.max_seq_len"):
        build_rollout_source(make_cfg(model={"max_seq_len": 10}))
    with pytest.raises(ConfigError, match=r"rollout.task='nope' is not a registered task"):
        build_rollout_source(make_cfg(rollout={"task": "nope"}))
    # A larger model vocabulary is fine: the sampler draws from the model's whole head.
    big = build_rollout_source(make_cfg(model={"hf_config": {**TINY, "vocab_size": 20}}))
    assert big.vocab_size == 20
    big.next_rollout(0).validate(vocab_size=20, max_seq_len=32, samples_per_prompt=4)


def test_write_task_rollouts_round_trip(tmp_path):
    cfg = make_cfg(rollout={"task": "add_small", "max_new_tokens": 4}, model={"max_seq_len": 16})
    path = tmp_path / "add.jsonl"
    assert write_task_rollouts(path, cfg, n_rollouts=2, seed=11) == 24
    assert len([line for line in path.read_text().splitlines() if line]) == 24
    file_source = FileRolloutSource(path, rollout_size=12)
    sampler = build_rollout_source(make_cfg(**{**_ADD, "seed": 11}))
    for step in range(2):
        from_file, fresh = file_source.next_rollout(step), sampler.next_rollout(step)
        from_file.validate(vocab_size=15, max_seq_len=16, samples_per_prompt=4)
        for x, y in zip(from_file.samples, fresh.samples):
            assert x.prompt_tokens.tolist() == y.prompt_tokens.tolist()
            assert x.response_tokens.tolist() == y.response_tokens.tolist()
            assert x.reward == y.reward and x.group_id == y.group_id
            torch.testing.assert_close(x.rollout_logprobs, y.rollout_logprobs, atol=1e-7, rtol=0)


_ADD = {"rollout": {"task": "add_small", "max_new_tokens": 4}, "model": {"max_seq_len": 16}}


def test_file_source_hands_out_the_records_policy_versions(tmp_path):
    """A record's ``policy_version`` reaches its sample (None where the record has none); the
    step's version metrics take the oldest: trainer at version 7, rollout versions {5, 6, None}
    -> rollout/policy_version 5, rollout/staleness 7 - 5 = 2."""
    from unirl.rollouts.source import policy_version_metrics

    records = [
        {"prompt_tokens": [1], "response_tokens": [2], "reward": 0.0, "group_id": 0}
        | ({} if v is None else {"policy_version": v})
        for v in (6, 5, None, 6)
    ]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    batch = FileRolloutSource(path, rollout_size=4).next_rollout(0)
    assert [s.policy_version for s in batch.samples] == [6, 5, None, 6]
    assert [s.to_record().get("policy_version") for s in batch.samples] == [6, 5, None, 6]
    assert policy_version_metrics(batch, 7) == {
        "rollout/policy_version": 5.0,
        "rollout/staleness": 2.0,
    }
    unknown = FileRolloutSource(path, rollout_size=1)
    for _ in range(2):
        unknown.next_rollout(0)
    assert policy_version_metrics(unknown.next_rollout(2), 7) == {}  # the record has none
    path.write_text(json.dumps(records[0] | {"policy_version": -1}) + "\n")
    with pytest.raises(RolloutDataError, match=r"line 1: field 'policy_version' is int -1"):
        FileRolloutSource(path, rollout_size=1).next_rollout(0)
