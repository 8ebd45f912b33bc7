"""Prompt files (rollout.prompts) and named rewards (rollout.reward): line checks, tokenizers,
the seeded epoch stream and its resume, reward errors naming the sample, and the config keys."""

import copy
import json
import logging
from collections import Counter

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from tests.tiny_models import TINY_LLAMA
from unirl.cli import main
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.rollouts import build_rollout_source
from unirl.rollouts.build import build_task, run_tokenizer
from unirl.rollouts.data.hf_tokenizer import char_tokenizer_to_hf, save_hf_tokenizer
from unirl.rollouts.data.tokenizer import CharTokenizer
from unirl.rollouts.rewards.registry import REWARDS, NamedReward

REWARDS_MODULE = "tests.unit.custom_rewards"


pytestmark = pytest.mark.usefixtures("one_thread")


TINY = {**TINY_LLAMA, "vocab_size": 32}


def write_prompts(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def make_cfg(prompts, rollout=None, model=None, prompts_per_rollout=2, samples=2, seed=3):
    return config_from_dict(
        {
            "model": {"hf_config": dict(TINY), "max_seq_len": 24, "init_seed": 1, **(model or {})},
            "batch": {
                "prompts_per_rollout": prompts_per_rollout,
                "samples_per_prompt": samples,
                "samples_per_optimizer_step": prompts_per_rollout * samples,
                "micro_batch_size": prompts_per_rollout * samples,
            },
            "parallel": {"world_size": 1},
            "rollout": {
                "prompts": str(prompts),
                "reward": "math_answer",
                "max_new_tokens": 4,
                **(rollout or {}),
            },
            "train": {"seed": seed},
        }
    )


SUMS = [{"prompt": f"{a}+{b}=", "metadata": {"answer": a + b}} for a, b in [(1, 2), (3, 4), (5, 0)]]


# -- the file, line by line -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"line 2: not valid JSON"),
        ("[1, 2]", r"line 2: expected a JSON object"),
        ({"promt": "1+1="}, r"line 2: unknown field 'promt'; a prompt line holds 'prompt'"),
        ({"prompt": "1", "prompt_tokens": [1]}, r"line 2: give exactly one of .* found both"),
        ({"metadata": {}}, r"line 2: give exactly one of .* found neither"),
        ({"prompt": ""}, r"line 2: field 'prompt' is ''; give the prompt as a non-empty string"),
        ({"prompt": 5}, r"line 2: field 'prompt' is 5"),
        ({"prompt_tokens": [1, -2]}, r"line 2: field 'prompt_tokens' must be a non-empty list"),
        ({"prompt_tokens": ["a"]}, r"line 2: field 'prompt_tokens' must be"),
        ({"prompt_tokens": []}, r"line 2: field 'prompt_tokens' must be"),
        ({"prompt": "1", "metadata": [7]}, r"line 2: field 'metadata' is list; give an object"),
        ({"prompt_tokens": [1, 40, 3]}, r"line 2: field 'prompt_tokens' holds id 40, outside"),
    ],
)
def test_each_bad_line_names_file_line_and_field(tmp_path, line, message):
    path = write_prompts(tmp_path / "p.jsonl", [SUMS[0], line, SUMS[1]])
    with pytest.raises(RolloutDataError, match=message) as err:
        build_task(make_cfg(path))
    assert str(path) in str(err.value)


def test_empty_or_missing_file(tmp_path):
    empty = write_prompts(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(RolloutDataError, match=r"holds no prompts"):
        build_task(make_cfg(empty))
    with pytest.raises(ConfigError, match=r"rollout.prompts=.*does not exist"):
        build_task(make_cfg(tmp_path / "missing.jsonl"))


def test_text_goes_through_the_character_tokenizer_of_the_file(tmp_path):
    # Characters of the prompts and of the metadata answers: "+", "0"-"5", "7", "=", in
    # code-point order after the 4 special ids: + 4, 0 5, 1 6, 2 7, 3 8, 4 9, 5 10, 7 11, = 12.
    path = write_prompts(tmp_path / "p.jsonl", [*SUMS, {"prompt_tokens": [1, 9, 3]}])
    task = build_task(make_cfg(path))
    assert task.tokenizer.vocab_size == 13
    tokens = sorted(tuple(p.prompt_tokens) for p in task.problems)
    assert tokens == sorted(
        [(1, 6, 4, 7, 12, 3), (1, 8, 4, 9, 12, 3), (1, 10, 4, 5, 12, 3), (1, 9, 3)]
    )
    by_origin = {p.origin: p for p in task.problems}
    assert by_origin[f"{path} line 4"].prompt_text == "4"  # ids decoded for the reward
    assert by_origin[f"{path} line 1"].metadata == {"answer": 3}


def test_model_tokenizer_folder_is_used_and_saved(tmp_path):
    # A tokenizer over "0123456789+=" (ids 4-15 in that order) instead of the file's alphabet.
    folder = tmp_path / "tok"
    save_hf_tokenizer(char_tokenizer_to_hf(CharTokenizer("0123456789+=")), folder)
    path = write_prompts(tmp_path / "p.jsonl", SUMS[:1])
    cfg = make_cfg(path, model={"tokenizer": str(folder)})
    task = build_task(cfg)
    assert [tuple(p.prompt_tokens) for p in task.problems] == [(1, 5, 14, 6, 15, 3)]
    assert run_tokenizer(cfg)("1+2=")["input_ids"] == [1, 5, 14, 6, 15, 3]


def test_long_prompts_are_an_error_naming_the_line_or_skipped_by_option(tmp_path, caplog):
    # max_seq_len 24 - max_new_tokens 4 = 20 tokens; "<bos> 19 digits <sep>" is 21.
    long = {"prompt": "1" * 19, "metadata": {"answer": 1}}
    path = write_prompts(tmp_path / "p.jsonl", [SUMS[0], long, SUMS[1]])
    with pytest.raises(
        RolloutDataError, match=r"line 2: the prompt is 21 tokens, longer than .* 20"
    ):
        build_task(make_cfg(path))
    with caplog.at_level(logging.WARNING):
        task = build_task(make_cfg(path, rollout={"skip_long_prompts": True}))
    assert task.num_prompts == 2 and "1 of 3 prompts are longer" in caplog.text
    assert "lines 2" in caplog.text


# -- the stream -----------------------------------------------------------------------------


def test_stream_goes_round_the_file_in_seeded_epochs(tmp_path):
    records = [{"prompt": str(i), "metadata": {"answer": i}} for i in range(7)]
    path = write_prompts(tmp_path / "p.jsonl", records)

    def stream(seed, n=28):
        task = build_task(make_cfg(path, seed=seed))
        return [task.sample_problem(None).prompt_text for _ in range(n)]

    first = stream(seed=0)
    epochs = [first[i : i + 7] for i in range(0, 28, 7)]
    for epoch in epochs:  # every prompt once per epoch
        assert Counter(epoch) == Counter(str(i) for i in range(7))
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled between epochs
    assert stream(seed=0) == first  # the seed fixes the order
    assert stream(seed=1) != first


def assert_resumes_where_it_stopped(cfg) -> None:
    """A source of 3 prompts per rollout stopped after rollout 0 and resumed from its state
    hands out rollouts 1 and 2 of an uninterrupted source, sample for sample."""
    full = build_rollout_source(cfg)
    rollouts = [full.next_rollout(k) for k in range(3)]
    stopped = build_rollout_source(cfg)
    stopped.next_rollout(0)
    state = copy.deepcopy(stopped.state_dict())
    assert state["task_state"]["prompts_drawn"] == 3
    resumed = build_rollout_source(cfg)
    resumed.load_state_dict(state)
    for k in (1, 2):
        again = resumed.next_rollout(k)
        for a, b in zip(rollouts[k].samples, again.samples, strict=True):
            assert a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
            assert a.response_tokens.tolist() == b.response_tokens.tolist()
            assert a.reward == b.reward and a.group_id == b.group_id


def test_sampler_source_on_a_prompt_file_resumes_where_it_stopped(tmp_path):
    records = [{"prompt": f"{a}+{a}=", "metadata": {"answer": 2 * a}} for a in range(5)]
    cfg = make_cfg(write_prompts(tmp_path / "p.jsonl", records), prompts_per_rollout=3)
    assert_resumes_where_it_stopped(cfg)


class _EchoEngine:
    """Stands in for the vLLM engine (the prompt stream is under test, not generation): every
    response is the stop token, and each request's prompt is recorded."""

    def __init__(self, eos_id):
        self.eos_id, self.prompts = eos_id, []

    def generate(self, requests):
        from unirl.rollouts.serving.engine import EngineSample

        self.prompts += [list(r.prompt_tokens) for r in requests]
        return [
            EngineSample(response_tokens=(self.eos_id,), logprobs=(-0.5,), finished=True)
            for _ in requests
        ]


def _vllm_source(cfg):
    """The vLLM source the plug-in builds, without starting vLLM (the engine is an echo)."""
    from unirl.rollouts.vllm import VllmRolloutSource
    from unirl.rollouts.vllm.sleep import SleepCycle

    task = build_task(cfg)
    source = VllmRolloutSource(task, cfg, hf_config=None, vocab_size=32, seed=cfg.train.seed)
    source._engine = _EchoEngine(task.tokenizer.eos_id)
    source._sleep = SleepCycle(None, "off")  # what the engine's start sets up
    return source


def test_vllm_source_on_a_prompt_file_resumes_where_it_stopped(tmp_path):
    """Issue 28: the vLLM source restarted a prompt file from its first line on --resume. With
    5 prompts and 3 per rollout, rollout 1 holds the last 2 of the first epoch and 1 of the
    next: a restarted file would give the first epoch's first 3 instead."""
    records = [{"prompt": f"{a}+{a}=", "metadata": {"answer": 2 * a}} for a in range(5)]
    cfg = make_cfg(
        write_prompts(tmp_path / "p.jsonl", records),
        prompts_per_rollout=3,
        rollout={"source": "vllm"},
    )
    full = _vllm_source(cfg)
    prompts = [[s.metadata["prompt"] for s in full.next_rollout(k).samples] for k in range(3)]
    assert Counter(prompts[0][::2] + prompts[1][:4:2]) == Counter(r["prompt"] for r in records)
    stopped = _vllm_source(cfg)
    stopped.next_rollout(0)
    state = json.loads(json.dumps(stopped.state_dict()))  # as plain data, like a checkpoint
    assert state["task_state"]["prompts_drawn"] == 3
    resumed = _vllm_source(cfg)
    resumed.load_state_dict(state)
    for k in (1, 2):
        again = resumed.next_rollout(k)
        assert [s.metadata["prompt"] for s in again.samples] == prompts[k]
        assert [s.group_id for s in again.samples] == [3 * k + i // 2 for i in range(6)]
    assert resumed._engine.prompts == full._engine.prompts[6:]  # what reached the engine


def test_rewards_and_metadata_reach_every_sample(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", SUMS)
    cfg = make_cfg(
        path,
        rollout={"reward": f"{REWARDS_MODULE}:length_reward", "reward_options": {"scale": 0.5}},
    )
    source = build_rollout_source(cfg)
    batch = source.next_rollout(0)
    decoder = CharTokenizer("+012345=7")  # the file's alphabet, written out by hand
    for sample in batch.samples:
        response = decoder.decode(sample.response_tokens.tolist())
        assert sample.reward == 0.5 * len(response)  # per sample, from the ids
        assert sample.metadata["response"] == response
        line = int(sample.metadata["origin"].rsplit(" ", 1)[1])
        assert sample.metadata["prompt_metadata"] == SUMS[line - 1]["metadata"]
        assert sample.metadata["prompt"] == SUMS[line - 1]["prompt"]


# -- reward errors --------------------------------------------------------------------------


def rewards_of(tmp_path, reward, flagged_line=2):
    records = [dict(r, metadata=dict(r["metadata"])) for r in SUMS]
    records[flagged_line - 1]["metadata"]["boom"] = True
    path = write_prompts(tmp_path / "p.jsonl", records)
    task = build_task(make_cfg(path, rollout={"reward": f"{REWARDS_MODULE}:{reward}"}))
    problems = sorted(task.problems, key=lambda p: p.origin)
    return task, problems, path


def test_a_reward_that_raises_names_the_sample_and_line(tmp_path):
    task, problems, path = rewards_of(tmp_path, "fails_on_flagged")
    with pytest.raises(RolloutDataError) as err:
        task.rewards(problems, [[5, 2], [6, 2], [7, 2]])
    msg = str(err.value)
    assert f"failed on sample 1 ({path} line 2, response '1'): ValueError: cannot score" in msg


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("one_short", r"returned 2 rewards for 3 samples"),
        ("nan_for_flagged", r"gave sample 1 \(.* line 2, response '1'\) the reward nan"),
        ("text_reward", r"gave sample 0 .* the reward 'high'; return a finite number"),
    ],
)
def test_wrong_reward_values_name_the_sample(tmp_path, reward, message):
    task, problems, _ = rewards_of(tmp_path, reward)
    with pytest.raises(RolloutDataError, match=message):
        task.rewards(problems, [[5, 2], [6, 2], [7, 2]])


def test_math_answer_missing_answer_names_the_line(tmp_path):
    path = write_prompts(tmp_path / "p.jsonl", [SUMS[0], {"prompt": "2+2="}])
    task = build_task(make_cfg(path))
    problems = sorted(task.problems, key=lambda p: p.origin)
    with pytest.raises(
        RolloutDataError,
        match=r"sample 1 \(.*line 2, response '2'\): ValueError: .*metadata has no 'answer'",
    ):
        task.rewards(problems, [[6], [6]])
    # The file's characters "+123=" are ids 4-8: "1+2=" answered "3<eos>" (ids 7, 2) scores 1,
    # "2" (id 6) scores 0.
    assert task.rewards(problems[:1], [[7, 2]]) == [1.0]
    assert task.rewards(problems[:1], [[6]]) == [0.0]


# -- names, signatures, config keys ---------------------------------------------------------


def test_reward_names_and_signatures_are_checked():
    assert {"math_answer", "exact_match"} <= set(REWARDS.names())
    with pytest.raises(
        ConfigError, match=r"rollout.reward='math_answr'.*did you mean 'math_answer'"
    ):
        NamedReward("math_answr")
    with pytest.raises(ConfigError, match=r"cannot be called as def reward\(prompts, responses"):
        NamedReward(f"{REWARDS_MODULE}:no_metadata_parameter")
    with pytest.raises(ConfigError, match=r"reward_options=\{'bogus': 1\}"):
        NamedReward(f"{REWARDS_MODULE}:length_reward", {"bogus": 1})
    with pytest.raises(ConfigError, match=r"has no callable 'missing'"):
        NamedReward(f"{REWARDS_MODULE}:missing")


@pytest.mark.parametrize(
    ("rollout", "model", "message"),
    [
        ({"reward": "math_answer"}, {}, r"rollout.reward='math_answer' applies to prompts"),
        ({"reward_options": {"a": 1}}, {}, r"rollout.reward_options=\{'a': 1\} applies"),
        ({"skip_long_prompts": True}, {}, r"rollout.skip_long_prompts=True applies"),
        ({}, {"tokenizer": "tok"}, r"model.tokenizer='tok' applies to prompts"),
        ({"prompts": "p.jsonl"}, {}, r"rollout.prompts needs rollout.reward"),
        ({"prompts": "p.jsonl", "reward": "math_answer", "source": "file", "file": "r.jsonl"},
         {}, r"rollout.source: file trains on finished rollouts"),
        ({"prompts": "p.jsonl", "reward": "math_answer", "task_options": {"max_digits": 3}},
         {}, r"rollout.task_options configure rollout.task, which rollout.prompts replaces"),
    ],
)  # fmt: skip
def test_config_refuses_keys_that_would_change_nothing(rollout, model, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(
            {
                "model": {"hf_config": dict(TINY), **model},
                "batch": {"micro_batch_size": 4},
                "rollout": rollout,
            }
        )


def test_unirl_check_imports_the_reward_and_reads_the_file(tmp_path, capsys):
    path = write_prompts(tmp_path / "p.jsonl", SUMS)
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"hf_config": TINY, "max_seq_len": 24},
                                  "batch": {"micro_batch_size": 32},
                                  "rollout": {"prompts": str(path), "reward": "math_answer",
                                              "max_new_tokens": 4}}))  # fmt: skip
    assert main(["check", str(config)]) == 0
    bad_reward = ["--set", f"rollout.reward={REWARDS_MODULE}:no_metadata_parameter"]
    assert main(["check", str(config), *bad_reward]) == 2
    assert "cannot be called as def reward" in capsys.readouterr().err
    write_prompts(path, [SUMS[0], {"prompt": "1" * 30}])
    assert main(["check", str(config)]) == 2
    assert "line 2: the prompt is 32 tokens" in capsys.readouterr().err


def test_export_gets_the_run_tokenizer_unless_model_path_brought_one(tmp_path):
    from transformers import AutoTokenizer

    from unirl.rollouts.build import save_run_tokenizer

    path = write_prompts(tmp_path / "p.jsonl", SUMS)
    export = tmp_path / "hf"
    export.mkdir()
    assert save_run_tokenizer(make_cfg(path), export)
    # "1+2=" through the file's tokenizer ("+" 4, "1" 6, "2" 7, "=" 12; see above).
    assert AutoTokenizer.from_pretrained(str(export))("1+2=")["input_ids"] == [1, 6, 4, 7, 12, 3]
    # A tokenizer already in the export (copied from model.path by the backend) is kept.
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "tokenizer_config.json").write_text("{}")
    assert not save_run_tokenizer(make_cfg(path), kept)
    assert (kept / "tokenizer_config.json").read_text() == "{}"
    # A built-in task's export carries its character tokenizer (digits: ids 4-13).
    task_cfg = config_from_dict(
        {"model": {"hf_config": dict(TINY)}, "batch": {"micro_batch_size": 32},
         "rollout": {"task": "reverse_digits"}}
    )  # fmt: skip
    assert save_run_tokenizer(task_cfg, tmp_path / "task")
    loaded = AutoTokenizer.from_pretrained(str(tmp_path / "task"))
    assert loaded("907")["input_ids"] == [1, 13, 4, 11, 3]
