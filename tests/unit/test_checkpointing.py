import random

import pytest
import torch

from unirl.core.errors import ConfigError
from unirl.core.run import checkpointing as ck
from unirl.core.run.metrics_log import MetricsLog, read_metrics


def _make(root, step, complete=True, run_id="run-a"):
    """A checkpoint the way a backend writes one: into .partial, then published."""
    path = ck.step_dir(root, step)
    partial = ck.partial_dir(path)
    (partial / "sub").mkdir(parents=True)
    (partial / "model.bin").write_text("w" * step)
    (partial / "sub" / "optim.bin").write_text("opt")
    if complete:
        ck.publish(partial, path, {"world_size": 1}, client_state={"run_id": run_id})
        return path
    return partial


def test_latest_complete_skips_crashed_saves(tmp_path):
    assert ck.latest_complete(tmp_path / "none") is None
    _make(tmp_path, 2)
    _make(tmp_path, 10)
    _make(tmp_path, 12, complete=False)  # a crashed save: only step_0000012.partial exists
    (tmp_path / "notes").mkdir()
    step, path = ck.latest_complete(tmp_path)
    assert step == 10 and path.name == "step_0000010"
    assert ck.read_marker(path) == {"world_size": 1}


def test_read_marker_names_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ck.read_marker(tmp_path / "step_0000001")
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="has no 'complete' marker"):
        ck.read_marker(tmp_path / "half")


def test_publish_replaces_an_older_save_of_the_same_step(tmp_path):
    _make(tmp_path, 3)
    partial = ck.partial_dir(ck.step_dir(tmp_path, 3))
    partial.mkdir()
    (partial / "model.bin").write_text("new")
    ck.publish(partial, ck.step_dir(tmp_path, 3), {"world_size": 2}, client_state={})
    assert (ck.step_dir(tmp_path, 3) / "model.bin").read_text() == "new"
    assert not partial.exists()


def test_prune_keeps_newest_and_removes_crash_leftovers(tmp_path):
    for s in (1, 2, 3):
        _make(tmp_path, s)
    leftover = _make(tmp_path, 0, complete=False)
    newer_partial = _make(tmp_path, 4, complete=False)  # may be a save in progress: kept
    removed = ck.prune(tmp_path, keep=2, run_id="run-a")
    assert sorted(p.name for p in removed) == ["step_0000000.partial", "step_0000001"]
    assert not leftover.exists() and newer_partial.exists()
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [2, 3]


def test_rng_state_round_trip():
    state = ck.rng_state()
    expected = (random.random(), torch.rand(3))
    random.random(), torch.rand(3)  # move the streams on
    ck.set_rng_state(state)
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


class _Payload:
    """Stands for pickled code in a checkpoint file: unpickling it would call ``__reduce__``."""

    def __reduce__(self):
        return (print, ("code ran",))


def test_state_files_load_without_unpickling_code(tmp_path):
    # the RNG states unirl writes (numpy's array included) load as they are
    torch.save(ck.rng_state(), tmp_path / "rng.pt")
    state = ck.load_state(tmp_path / "rng.pt")
    expected = (random.random(), torch.rand(3))
    ck.set_rng_state(state)
    assert (random.random(), *torch.rand(3).tolist()) == (expected[0], *expected[1].tolist())
    # a file holding anything that pickles code is refused before it runs
    torch.save({"steps_done": 3, "hook": _Payload()}, tmp_path / "meta.pt")
    with pytest.raises(ConfigError, match="which unirl does not unpickle"):
        ck.load_state(tmp_path / "meta.pt")


def test_metrics_log_writes_jsonl_and_truncates_on_resume(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.write(
            step, {"reward/mean": step / 10, "old_logprobs/source": "reuse", "bad": float("nan")}
        )
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["reward/mean"] == 0.1 and rows[0]["bad"] == "nan"
    # resuming from the checkpoint of step 2 rewrites step 3
    log = MetricsLog(tmp_path, tensorboard=False, resume_from_step=2)
    log.write(3, {"reward/mean": 0.5})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward/mean"] == 0.5


# -- issue 15: crash consistency and ownership ------------------------------------------------


def test_marker_records_every_file_and_its_size(tmp_path):
    path = _make(tmp_path, 5)
    info = ck.run_info(path)
    assert info["run_id"] == "run-a"
    assert info["files"] == {"model.bin": 5, "sub/optim.bin": 3}
    assert ck.damage(path) is None


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, how):
    _make(tmp_path, 2)
    newest = _make(tmp_path, 4)
    if how == "truncate":  # what a crash after the marker, or a disk error, can leave
        (newest / "sub" / "optim.bin").write_text("o")
        why = "file sub/optim.bin has 1 bytes, 3 were written"
    else:
        (newest / "model.bin").unlink()
        why = "file model.bin is missing"
    assert ck.damage(newest) == why
    step, path = ck.latest_complete(tmp_path)
    assert step == 2 and path.name == "step_0000002"
    assert f"checkpoint {newest} is damaged ({why})" in caplog.text


def test_unreadable_marker_is_damage_not_a_traceback(tmp_path):
    _make(tmp_path, 1)
    newest = _make(tmp_path, 2)
    (newest / ck.COMPLETE_MARKER).write_text('{"world_size": 1, "unir')  # cut off
    assert ck.latest_complete(tmp_path)[0] == 1
    with pytest.raises(ConfigError, match="marker cannot be read"):
        ck.read_marker(newest)


def test_prune_deletes_only_the_asking_runs_checkpoints(tmp_path):
    # finding 1: run B pruned run A's checkpoints and then its own fresh ones
    for s in (10, 20, 30):
        _make(tmp_path, s, run_id="A")
    for s in (1, 2, 3):
        _make(tmp_path, s, run_id="B")
    removed = ck.prune(tmp_path, keep=2, run_id="B")
    assert [p.name for p in removed] == ["step_0000001"]
    left = [s for s, _ in ck.complete_checkpoints(tmp_path)]
    assert left == [2, 3, 10, 20, 30]


def test_metrics_log_drops_a_cut_off_last_line(tmp_path, caplog):
    # finding 4: a killed write or a full disk leaves half a line; resume crashed on it
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    log = MetricsLog(tmp_path, tensorboard=False, resume_from_step=2)
    log.write(3, {"loss": 0.3})
    log.close()
    assert path.read_text().splitlines()[-1] == '{"step": 3, "loss": 0.3}'
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert "dropped 1 cut-off line" in caplog.text
    # also when a run appends without resuming: the new record never joins the half line
    path.write_text('{"step": 1}\n{"st')
    log = MetricsLog(tmp_path, tensorboard=False)
    log.write(2, {})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
