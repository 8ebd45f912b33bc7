"""Issue 15, findings 2, 3 and 7: expected failures reach the user as one ``unirl: error:`` line
naming the key or path and the fix (exit 2), tracebacks only with ``--debug``; `unirl check`
catches what `train` would only find later (hooks, the task and its options)."""

from pathlib import Path

import pytest

from unirl.cli import main

TINY = str(Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml")


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
        (f"{HOOK}=nonexistent_mod:fn", "cannot import module 'nonexistent_mod'"),
        (f"{HOOK}=tests.unit.custom_components:missing", "has no callable 'missing'"),
        (f"{HOOK}=no_colon", "must look like 'package.module:function'"),
        (
            f"{HOOK}=tests.unit.custom_components:hook_without_rl_step",
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
    hook = "tests.unit.custom_components:zero_rewards_hook"
    assert main(["check", TINY, "--set", f"{HOOK}={hook}"]) == 0


def test_train_errors_before_any_work_are_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _error(capsys, ["train", TINY, "--set", f"logging.run_dir={blocker}/run"])
    assert f"logging.run_dir={str(blocker / 'run')!r} is not a writable directory" in line
    run = f"logging.run_dir={tmp_path / 'run'}"
    line = _error(capsys, ["train", TINY, "--set", run, "--rollouts", str(tmp_path / "no.jsonl")])
    assert "rollout.file=" in line and "does not exist" in line
    line = _error(capsys, ["train", TINY, "--set", run, "--resume", "--overwrite"])
    assert "--resume continues the run" in line


def test_debug_shows_the_traceback(capsys, tmp_path):
    argv = ["--debug", "check", TINY, "--set", f"{HOOK}=nonexistent_mod:fn"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("unirl: error: ")
