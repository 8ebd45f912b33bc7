"""Issue 15, findings 1 and 4: a run directory belongs to one run, and it is checked before any
work (ownership, writability)."""

import os

import pytest

from unirl.core.errors import ConfigError
from unirl.core.run import checkpointing as ck
from unirl.core.run import run_dir as rd


def _old_run(run_dir, run_id="A"):
    run_dir.mkdir(parents=True)
    rd.write_run_id(run_dir, run_id)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    path = ck.step_dir(run_dir / "checkpoints", 30)
    partial = ck.partial_dir(path)
    partial.mkdir(parents=True)
    (partial / "model.bin").write_text("w")
    ck.publish(partial, path, {}, client_state={"run_id": run_id})


def test_new_run_refuses_a_directory_holding_another_run(tmp_path):
    run = tmp_path / "run"
    _old_run(run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as info:
        rd.claim(run, run / "checkpoints", resume=False, overwrite=False)
    msg = str(info.value)
    assert f"logging.run_dir={str(run)!r} already holds a run" in msg
    assert "--resume" in msg and "--overwrite" in msg
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_checkpoints_alone_mark_a_used_directory(tmp_path):
    # a shared checkpoint.dir with another run's checkpoints is refused too
    _old_run(tmp_path / "a")
    with pytest.raises(ConfigError, match="already holds a run"):
        rd.claim(tmp_path / "b", tmp_path / "a" / "checkpoints", resume=False, overwrite=False)


def test_resume_continues_the_runs_own_id_and_overwrite_clears(tmp_path):
    run = tmp_path / "run"
    _old_run(run, "A")
    assert rd.claim(run, run / "checkpoints", resume=True, overwrite=False) == "A"
    (run / "run.json").unlink()  # an older run dir: the id comes from its newest checkpoint
    assert rd.claim(run, run / "checkpoints", resume=True, overwrite=False) == "A"
    with pytest.raises(ConfigError, match="give one"):
        rd.claim(run, run / "checkpoints", resume=True, overwrite=True)
    assert rd.claim(run, run / "checkpoints", resume=False, overwrite=True) is None
    rd.clear_previous_run(run, run / "checkpoints")
    assert sorted(p.name for p in run.rglob("*")) == ["checkpoints"]
    assert rd.claim(run, run / "checkpoints", resume=False, overwrite=False) is None
    # nothing left to continue: --resume says so instead of starting a whole new run
    with pytest.raises(ConfigError, match=r"--resume: logging.run_dir=.* holds no run to continue"):
        rd.claim(run, run / "checkpoints", resume=True, overwrite=False)
    with pytest.raises(ConfigError, match=r"holds no run to continue"):
        rd.claim(
            tmp_path / "never", tmp_path / "never" / "checkpoints", resume=True, overwrite=False
        )


def test_unwritable_directory_is_found_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError) as info:
        rd.check_writable(blocker / "ckpts", "checkpoint.dir")
    assert f"checkpoint.dir={str(blocker / 'ckpts')!r} is not a writable directory" in str(
        info.value
    )
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="Permission denied"):
            rd.check_writable(locked, "logging.run_dir")
