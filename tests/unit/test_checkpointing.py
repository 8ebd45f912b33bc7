import json

from unirl.core import checkpointing as ck
from unirl.core.metrics_log import MetricsLog, read_metrics


def _make(root, step, complete=True):
    path = ck.step_dir(root, step)
    path.mkdir(parents=True)
    (path / "model.bin").write_text("w")
    if complete:
        ck.mark_complete(path)
    return path


def test_latest_complete_skips_incomplete(tmp_path):
    assert ck.latest_complete(tmp_path / "none") is None
    _make(tmp_path, 2)
    _make(tmp_path, 10)
    _make(tmp_path, 12, complete=False)  # a crashed save
    (tmp_path / "notes").mkdir()
    step, path = ck.latest_complete(tmp_path)
    assert step == 10 and path.name == "step_0000010"


def test_prune_keeps_newest_and_removes_crash_leftovers(tmp_path):
    for s in (1, 2, 3):
        _make(tmp_path, s)
    leftover = _make(tmp_path, 0, complete=False)
    newer_partial = _make(tmp_path, 4, complete=False)  # may be a save in progress: kept
    removed = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step_0000000", "step_0000001"]
    assert not leftover.exists() and newer_partial.exists()
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [2, 3]


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
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert json.loads(lines[-1])["reward/mean"] == 0.5
