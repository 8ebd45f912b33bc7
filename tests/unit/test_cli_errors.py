"""Issue 15, findings 2, 3 and 7: expected failures reach the user as one ``unirl: error:`` line
naming the key or path and the fix (exit 2), tracebacks only with ``--debug``; `unirl check`
catches what `train` would only find later (hooks, the task and its options)."""

from pathlib import Path

import pytest

from unirl.cli import main

TINY = str(Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml")
NO_HF = "model.hf_config=null"  # an example's hf_config gives way to model.path


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("unirl: error: ")
    return lines[0]


HOOK = "algorithm.rollout_postprocess_hook"


@pytest.mark.parametrize(
    "override, words",
    [
        # finding 2: these passed `unirl check`; .inf exported NaN weights, the others crashed
        # `train` with a traceback or (grad_clip < 0) silently turned clipping off
        ("optimizer.lr=.inf", "optimizer.lr must be a finite number > 0 and <= 1e+30, got inf"),
        ("optimizer.lr=.nan", "optimizer.lr must be a finite number > 0 and <= 1e+30, got nan"),
        ("optimizer.lr=1e39", "optimizer.lr must be > 0 and <= 1e+30, got 1e+39"),
        (
            "optimizer.betas=[0.9, 1.5]",
            "optimizer.betas=[0.9, 1.5]: entry 1 (1.5) must be in [0, 1)",
        ),
        ("optimizer.betas=[-0.1, 0.9]", "optimizer.betas=[-0.1, 0.9]: entry 0 (-0.1)"),
        ("optimizer.grad_clip=-1", "optimizer.grad_clip must be > 0, got -1.0"),
        ("optimizer.eps=.nan", "optimizer.eps must be a finite number > 0, got nan"),
        ("model.hf_config.vocab_size=-16", "model.hf_config.vocab_size=-16 must be a positive"),
        ("model.hf_config.hidden_size=130", "model.hf_config.hidden_size=130 is not divisible by"),
        ("model.hf_config.num_key_value_heads=3", "num_attention_heads=4 is not divisible by"),
        ("algorithm.dual_clip=.nan", "algorithm.dual_clip must be finite, got nan"),
        ("algorithm.gamma=1.5", "algorithm.gamma must be in [0, 1], got 1.5"),
        ("algorithm.entropy_coef=.inf", "algorithm.entropy_coef must be finite, got inf"),
        ("algorithm.kl_loss.coef=.nan", "algorithm.kl_loss.coef must be finite, got nan"),
        ("rollout.top_p=.nan", "rollout.top_p must be a finite number > 0 and <= 1, got nan"),
        ("rollout.temperature=.inf", "rollout.temperature must be a finite number > 0, got inf"),
        ("parallel.timeout_s=0", "parallel.timeout_s must be > 0, got 0"),
        ("train.max_consecutive_skipped_steps=-1", "max_consecutive_skipped_steps must be >= 0"),
    ],
)
def test_check_refuses_bad_numbers_naming_the_key(capsys, override, words):
    line = _error(capsys, ["check", TINY, "--set", override])
    assert words in line, line


@pytest.mark.parametrize(
    "override, words",
    [
        (f"{HOOK}=nonexistent_mod:fn", "cannot import module 'nonexistent_mod'"),
        (f"{HOOK}=tests.unit.custom_hooks:missing", "has no callable 'missing'"),
        (f"{HOOK}=no_colon", "must look like 'package.module:function'"),
        (
            f"{HOOK}=tests.unit.custom_hooks:hook_without_rl_step",
            "cannot be called as hook(batch, *, rl_step)",
        ),
        ("rollout.task=reverse_digit", "rollout.task='reverse_digit' is not a registered task"),
        ("rollout.task_options={max_digitz: 3}", "rollout.task_options={'max_digitz': 3} do not"),
        ("rollout.max_new_tokens=2", "rollout.max_new_tokens=2 is shorter than the longest"),
    ],
)
def test_check_validates_hooks_and_the_task(capsys, override, words):
    line = _error(capsys, ["check", TINY, "--set", override])
    assert words in line, line


def test_check_accepts_a_good_hook(capsys):
    hook = "tests.unit.custom_hooks:zero_rewards_hook"
    assert main(["check", TINY, "--set", f"{HOOK}={hook}"]) == 0


EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize(
    "example, override, words",
    [
        # issue 44 item 17: `check` itself crashed (TypeError) on the first, passed the others
        (
            "tiny_grpo.yaml",
            "eval={every: 2}",
            "eval has no eval.prompts, which it needs; set it (the section's keys: ['every', ",
        ),
        (
            "tiny_multiturn.yaml",
            "rollout.environment=no_such_env",
            "rollout.environment='no_such_env' is not a registered environment; valid: "
            "['hidden_number'], or an environment class as 'package.module:Class'",
        ),
        (
            "tiny_multiturn.yaml",
            "rollout.environment=tests.unit.custom_hooks:no_env",
            "has no callable 'no_env'",
        ),
        # the sample's "answer" column is not mapped: no prompt has metadata["answer"]
        (
            "gsm8k.yaml",
            "rollout.answer_key=null",
            "train.parquet prompt 0: the prompt's "
            "metadata has no 'answer' (keys: []); map the dataset's solution column with "
            "rollout.answer_key",
        ),
        # a column of bare numbers is not a GSM8K solution
        (
            "gsm8k.yaml",
            "rollout.answer_key=question",
            "train.parquet prompt 0: metadata 'answer'=",
        ),
    ],
)
def test_check_refuses_what_the_run_would_meet_later(capsys, example, override, words):
    line = _error(capsys, ["check", str(EXAMPLES / example), "--set", override])
    assert words in line, line


def test_train_errors_before_any_work_are_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _error(capsys, ["train", TINY, "--set", f"logging.run_dir={blocker}/run"])
    assert f"logging.run_dir={str(blocker / 'run')!r} is not a writable directory" in line
    run = f"logging.run_dir={tmp_path / 'run'}"
    line = _error(capsys, ["train", TINY, "--set", run, "--rollouts", str(tmp_path / "no.jsonl")])
    assert "rollout.file=" in line and "does not exist" in line
    line = _error(
        capsys,
        ["train", TINY, "--set", run, "--set", "model.path=/no/such/model", "--set", NO_HF],
    )
    assert "model.path='/no/such/model' is not a directory" in line  # was a Hub repo-id error
    line = _error(capsys, ["train", TINY, "--set", run, "--resume", "--overwrite"])
    assert "--resume continues the run" in line


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_model_folder_without_a_usable_config_json_is_one_line(capsys, tmp_path, command):
    """An empty or broken config.json failed inside transformers with a 37-line traceback."""
    run = ["--set", f"logging.run_dir={tmp_path / 'run'}", "--set", NO_HF]
    folder = tmp_path / "model"
    folder.mkdir()
    for content, words in [
        (None, "has no config.json"),
        ("", "config.json is not readable JSON"),
        ("[]", "config.json names no model_type"),
        ('{"hidden_size": 8}', "config.json names no model_type"),
    ]:
        if content is not None:
            (folder / "config.json").write_text(content)
        line = _error(capsys, [command, TINY, "--set", f"model.path={folder}", *run])
        assert words in line and "model.path" in line, line


@pytest.mark.parametrize("command", ["check", "train"])
def test_missing_local_paths_are_refused_by_check_as_by_train(capsys, tmp_path, command):
    run = ["--set", f"logging.run_dir={tmp_path / 'run'}"]
    math = str(Path(TINY).parent / "tiny_math.yaml")
    for config, override, words in [
        (TINY, ["model.path=/no/such/model", "--set", NO_HF],
         "model.path='/no/such/model' is not a directory"),
        (math, "model.tokenizer=/no/such/tok", "model.tokenizer='/no/such/tok' is not a directory"),
        (math, "rollout.prompts=/no/such.parquet", "rollout.prompts='/no/such.parquet' does not "
         "exist"),
    ]:  # fmt: skip
        override = override if isinstance(override, list) else [override]
        line = _error(capsys, [command, config, "--set", *override, *run])
        assert words in line, line


def test_check_says_when_the_mismatch_metrics_are_not_logged(capsys):
    assert main(["check", TINY, "--set", "old_logprobs=rollout"]) == 0
    out = capsys.readouterr().out
    assert "train/rollout mismatch metrics: not logged: with old_logprobs: rollout" in out
    assert main(["check", TINY, "--set", "rollout.top_p=0.9"]) == 0
    out = capsys.readouterr().out
    assert "with rollout.top_p=0.9 the sampler reports untruncated log-probs" in out


def test_debug_shows_the_traceback(capsys, tmp_path):
    argv = ["--debug", "check", TINY, "--set", f"{HOOK}=nonexistent_mod:fn"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("unirl: error: ")


def test_a_reader_that_closes_the_pipe_is_not_a_disk_error():
    """`unirl check | head -1`: the reader goes away after one line; unirl ends quietly with
    SIGPIPE's status, as a Unix tool does, instead of "unirl: error: Broken pipe"."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.cli", "check", TINY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    assert proc.stdout.readline().startswith(b"# layout")
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "unirl: error" not in err and "Traceback" not in err, err


def test_train_refuses_what_check_refuses_before_any_work(capsys, tmp_path):
    """old_logprobs: reuse with rollouts generated ahead: check refused it, train ran a step and
    died at the first stale rollout."""
    run = tmp_path / "run"
    argv = ["--set", "old_logprobs=reuse", "--set", "train.max_staleness=1",
            "--set", f"logging.run_dir={run}"]  # fmt: skip
    assert "old_logprobs: reuse is invalid" in _error(capsys, ["check", TINY, *argv])
    assert "old_logprobs: reuse is invalid" in _error(capsys, ["train", TINY, *argv])
    assert not (run / "run.json").exists() and not (run / "metrics.jsonl").exists()


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_hub_id_given_as_a_path_says_how_to_download_it(capsys, tmp_path, command):
    """unirl reads local folders only; a Hub id in model.path or rollout.prompts got "is not a
    directory" and nothing more. A path with more than owner/name, or an existing folder, gets no
    hint."""
    run = ["--set", f"logging.run_dir={tmp_path / 'run'}"]
    math = str(Path(TINY).parent / "tiny_math.yaml")
    line = _error(capsys, [command, TINY, "--set", "model.path=Qwen/Qwen3-0.6B", "--set", NO_HF,
                           *run])  # fmt: skip
    assert "looks like a Hugging Face Hub id" in line
    assert "hf download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B" in line
    line = _error(capsys, [command, math, "--set", "rollout.prompts=openai/gsm8k", *run])
    assert "hf download openai/gsm8k --repo-type dataset --local-dir ./gsm8k" in line
    line = _error(capsys, [command, TINY, "--set", "model.path=/no/such/model", "--set", NO_HF,
                           *run])  # fmt: skip
    assert "Hub id" not in line


def test_a_prompt_the_tokenizer_cannot_encode_is_one_line(capsys, tmp_path):
    """The tiny examples' character tokenizer has no unknown token: a held-out prompt with a
    character outside it crashed `check` (and `train`) with the tokenizer's traceback."""
    held = tmp_path / "held.jsonl"
    held.write_text('{"prompt": "What is 1 plus 1? Answer:", "metadata": {"answer": 2}}\n')
    line = _error(
        capsys, ["check", str(EXAMPLES / "tiny_math.yaml"), "--set", f"eval={{prompts: {held}}}"]
    )
    assert f"{held} line 1: the tokenizer cannot encode the prompt 'What is 1 plus" in line, line
