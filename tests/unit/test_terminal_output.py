"""What a user sees on the terminal: log lines never written into a progress bar, unirl's lines at
``logging.level``, the engines' chatter (DeepSpeed, torch.distributed, vLLM, transformers) only
at DEBUG, and a generation bar beside the training bars."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from unirl import log_setup
from unirl.backends.engine_output import engine_prints
from unirl.log_setup import TqdmHandler, apply_log_level, engine_loggers

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_grpo.yaml"
# the CLI's record format: "2026-11-30 22:38:53,716 INFO unirl.train: ..."
RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def segments(text: str) -> list[str]:
    """What a terminal shows as separate writes: pieces between carriage returns and newlines,
    without cursor movements."""
    return [ANSI.sub("", piece) for piece in re.split(r"[\r\n]", text)]


def glued_records(text: str) -> list[str]:
    """Pieces holding a log record that does not begin the piece (it was written after bar
    text, on the bar's line)."""
    return [s for s in segments(text) if RECORD.search(s) and not RECORD.match(s)]


@pytest.fixture
def restore_logging():
    """apply_log_level changes process-wide state: put it back."""
    names = ("unirl", *engine_loggers())
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}
    env = os.environ.get("VLLM_LOGGING_LEVEL")
    set_here = dict(log_setup._env_set_here)
    # start as a fresh process would: an earlier in-process run may have set the variable
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
    log_setup._env_set_here.clear()
    yield
    for name, (level, filters) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.filters[:] = filters
    if env is None:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
    else:
        os.environ["VLLM_LOGGING_LEVEL"] = env
    log_setup._env_set_here.clear()
    log_setup._env_set_here.update(set_here)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()
    except ImportError:
        pass


def test_the_check_of_this_file_sees_a_glued_record():
    # what the run printed before routing logs through tqdm: the first INFO line of a run
    # written straight after the run bar
    before = (
        "\rRL steps:   0%|          | 0/3 [00:00 elapsed]2026-11-30 22:36:09,045 INFO "
        "unirl.core.old_logprobs: old log-probs: reuse\n"
    )
    assert glued_records(before)
    after = (
        "\rRL steps:   0%|          | 0/3 [00:00 elapsed]\r            \r2026-11-30 22:36:09,045 "
        "INFO unirl.core.old_logprobs: old log-probs: reuse\n\rRL steps:   0%|\n"
    )
    assert not glued_records(after)


def test_handler_writes_records_between_bars(capsys):
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter(log_setup.FORMAT))
    record = logging.LogRecord("unirl.x", logging.INFO, __file__, 1, "hello", None, None)
    with tqdm(total=4, desc="RL steps", file=sys.stderr, mininterval=0) as bar:
        bar.update(1)
        handler.emit(record)
        bar.update(1)
    err = capsys.readouterr().err
    assert "RL steps" in err and "INFO unirl.x: hello" in err
    assert not glued_records(err)
    plain = logging.StreamHandler(sys.stderr)  # what logging.basicConfig installs
    plain.setFormatter(logging.Formatter(log_setup.FORMAT))
    with tqdm(total=4, desc="RL steps", file=sys.stderr, mininterval=0) as bar:
        bar.update(1)
        plain.emit(record)
    assert glued_records(capsys.readouterr().err)  # the check above can fail


def test_log_level_sets_unirl_and_quiets_engines_below_debug(restore_logging, capsys):
    def passes(name: str, level: int) -> bool:
        logger = logging.getLogger(name)
        record = logger.makeRecord(name, level, __file__, 1, "m", None, None)
        return logger.isEnabledFor(level) and bool(logger.filter(record))

    apply_log_level("WARNING")
    assert not passes("unirl.train", logging.INFO) and passes("unirl.train", logging.WARNING)
    apply_log_level("INFO")
    assert passes("unirl.train", logging.INFO) and not passes("unirl.train", logging.DEBUG)
    for name in ("DeepSpeed", "vllm.engine", "torch.distributed.c10d", "transformers.modeling"):
        assert not passes(name, logging.WARNING) and passes(name, logging.ERROR), name
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"  # for vLLM's engine processes
    with engine_prints():
        print("DeepSpeed op built successfully")
    assert capsys.readouterr().out == ""
    apply_log_level("DEBUG")
    assert passes("unirl.train", logging.DEBUG)
    for name in ("DeepSpeed", "vllm.engine", "torch.distributed.c10d", "transformers.modeling"):
        assert passes(name, logging.DEBUG), name
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    with engine_prints():
        print("DeepSpeed op built successfully")
    assert capsys.readouterr().out == "DeepSpeed op built successfully\n"


def test_vllm_level_set_by_the_user_is_kept(restore_logging, monkeypatch):
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    apply_log_level("WARNING")
    assert os.environ["VLLM_LOGGING_LEVEL"] == "INFO"


def _train(tmp_path: Path, *extra: str, bars: bool) -> subprocess.CompletedProcess:
    # found, not imported: importing DeepSpeed here would change the child's environment
    for module, pip_extra in (("deepspeed", "deepspeed"), ("transformers", "hf")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module} (pip install unirl[{pip_extra}])")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "UNIRL_PROGRESS": "1" if bars else "0"}
    args = [
        str(EXAMPLE), "--set", f"logging.run_dir={tmp_path / 'run'}", "--set", "train.rl_steps=2",
        "--set", "checkpoint.every=1", "--set", "logging.tensorboard=false",
        "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=32",
        *extra,
    ]  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def test_train_with_bars_keeps_log_lines_off_the_bars_and_engines_quiet(tmp_path):
    proc = _train(tmp_path, bars=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    # the bars were drawn: the run bar, the generation bar, the training bar
    for bar in ("RL steps:", "generate:", "actor train:"):
        assert bar in err, bar
    # records were written while bars were shown (the decision, both checkpoints)
    records = [s for s in segments(err) if RECORD.match(s)]
    assert any("old log-probs: reuse" in r for r in records)
    assert sum("checkpoint saved" in r for r in records) == 2
    assert glued_records(err) == []
    # the engines' own output stays off the terminal at logging.level INFO
    assert "Setting accelerator to CPU" not in err  # DeepSpeed's logger
    assert "distributed_c10d" not in err  # torch.distributed's INFO lines
    assert "built successfully" not in proc.stdout + err  # DeepSpeed's print
    assert "Writing model shards" not in err  # transformers' bar of the HF export


def test_train_at_debug_shows_unirl_debug_lines_and_the_engines(tmp_path):
    proc = _train(tmp_path, "--set", "logging.level=DEBUG", bars=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DEBUG unirl.rollouts.sampler_source: rollout 0:" in proc.stderr
    both = proc.stdout + proc.stderr
    assert "distributed_c10d.py" in both  # torch.distributed's INFO lines
    assert "built successfully" in both  # DeepSpeed's print
