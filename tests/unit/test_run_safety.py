"""Issue 15 end to end through `unirl train`: a used run directory is refused, a resume that
does not fit the checkpoint is refused, a damaged newest checkpoint and a cut-off metrics line
are survived, and a full disk mid-run ends in one error line with the newest complete checkpoint
intact. One scenario, so the tiny model is trained only three times (a few seconds each)."""

import hashlib
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")

from unirl.cli import main
from unirl.core.run import checkpointing as ck
from unirl.core.run.metrics_log import read_metrics

TINY = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"
SMALL = ["--set", "batch.prompts_per_rollout=2", "--set", "batch.samples_per_optimizer_step=16",
         "--set", "batch.micro_batch_size=16", "--set", "logging.tensorboard=false",
         "--set", "checkpoint.every=1", "--set", "checkpoint.keep=2"]  # fmt: skip


def _train(run: Path, *args: str, file_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:  # a "full disk": writing past `file_limit` bytes fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    return subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", str(TINY), *SMALL,
         "--set", f"logging.run_dir={run}", *args],
        capture_output=True, text=True, timeout=300,
        preexec_fn=limit if file_limit else None,
    )  # fmt: skip


def _snapshot(run: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("unirl: error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def _refused(capsys, run: Path, *args: str) -> str:
    """`unirl train` in this process, for runs refused before anything is built (no DeepSpeed
    state is created, so no fresh process is needed)."""
    argv = ["train", str(TINY), *SMALL, "--set", f"logging.run_dir={run}", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("unirl: error: ")]
    assert len(errors) == 1, err
    return errors[0]


def test_used_dir_bad_resume_damage_and_full_disk(tmp_path, capsys):
    run = tmp_path / "run"
    first = _train(run, "--set", "train.rl_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    rows_a = read_metrics(run / "metrics.jsonl")
    before = _snapshot(run)

    # finding 1: another run in the same directory is refused, and nothing is touched
    line = _refused(capsys, run, "--set", "train.rl_steps=2", "--set", "train.seed=7")
    assert f"logging.run_dir={str(run)!r} already holds a run" in line and "--overwrite" in line
    assert _snapshot(run) == before

    # finding 6: resuming with other batch sizes is refused before anything is loaded
    other_sizes = ["--set", "batch.prompts_per_rollout=4",
                   "--set", "batch.samples_per_optimizer_step=32"]  # fmt: skip
    line = _refused(capsys, run, "--resume", "--set", "train.rl_steps=3", *other_sizes)
    assert "does not fit this config (batch.prompts_per_rollout: checkpoint 2, now 4" in line
    assert _snapshot(run) == before

    # finding 4: the newest checkpoint is damaged after its marker was written (a file cut
    # short) and the metrics file ends in half a line; the disk then fills at the next save
    newest = ck.step_dir(run / "checkpoints", 2)
    victim = max((p for p in newest.rglob("*.pt")), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:1000])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward/me')
    full = _train(run, "--resume", "--set", "train.rl_steps=3", file_limit=300_000)
    line = _one_error_line(full)
    assert "is damaged" in full.stderr and "falling back" in full.stderr
    assert "writing checkpoint" in line and "failed" in line
    assert f"the newest complete checkpoint {ck.step_dir(run / 'checkpoints', 1)} is intact" in line
    assert ck.latest_complete(run / "checkpoints")[0] == 1  # untouched, still verified

    # space again: the resume continues from step 1 and ends with steps 1..3 logged once each
    done = _train(run, "--resume", "--set", "train.rl_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0] == rows_a[0]
    assert [s for s, _ in ck.complete_checkpoints(run / "checkpoints")] == [2, 3]
    assert ck.damage(ck.step_dir(run / "checkpoints", 2)) is None


def test_checkpoints_by_wall_time_survive_a_crash_by_default(tmp_path):
    """``checkpoint.every_minutes`` (30 by default, so a long run loses at most that much to a
    crash; ``checkpoint.every: 0`` used to save only at the end): a bound shorter than any step
    saves after every step (0, only at the end, is what the other runs here take by count)."""
    from unirl.core.config.sections.output import CheckpointConfig

    assert CheckpointConfig().every_minutes == 30.0 and CheckpointConfig().every == 0
    steps = ["--set", "train.rl_steps=3", "--set", "checkpoint.every=0", "--set",
             "checkpoint.keep=5", "--set", "checkpoint.export_hf=false"]  # fmt: skip
    for minutes, saved in (("1e-9", [1, 2, 3]),):
        run = tmp_path / f"run{minutes}"
        proc = _train(run, *steps, "--set", f"checkpoint.every_minutes={minutes}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = sorted(ck.step_number(p.name) for p in (run / "checkpoints").iterdir())
        assert found == saved, (minutes, found)
