import random

import pytest
import torch

from unirl.core.errors import ConfigError
from unirl.core.run import checkpointing as ck
from unirl.core.run.metrics_log import MetricsLog, read_metrics


def _make(root, step, complete=True):
    """A checkpoint the way a backend writes one: into .partial, then published."""
    path = ck.step_dir(root, step)
    partial = ck.partial_dir(path)
    partial.mkdir(parents=True)
    (partial / "model.bin").write_text("w")
    if complete:
        ck.publish(partial, path, {"world_size": 1})
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
    ck.publish(partial, ck.step_dir(tmp_path, 3), {"world_size": 2})
    assert (ck.step_dir(tmp_path, 3) / "model.bin").read_text() == "new"
    assert not partial.exists()


def test_prune_keeps_newest_and_removes_crash_leftovers(tmp_path):
    for s in (1, 2, 3):
        _make(tmp_path, s)
    leftover = _make(tmp_path, 0, complete=False)
    newer_partial = _make(tmp_path, 4, complete=False)  # may be a save in progress: kept
    removed = ck.prune(tmp_path, keep=2)
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
