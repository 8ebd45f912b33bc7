"""Issue 15, finding 6: resuming from a checkpoint of another architecture (before: a shape
traceback deep in the backend's load) or other batch sizes (before: silently accepted) is
refused before anything is loaded, naming each key; memory knobs may change."""

from pathlib import Path

import pytest

from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError
from unirl.core.run import checkpointing as ck
from unirl.core.run.resume import check_resume_fits

TINY = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"


def _checkpoint(root, cfg, run_id="A"):
    path = ck.step_dir(root, 10)
    partial = ck.partial_dir(path)
    partial.mkdir(parents=True)
    (partial / "model.bin").write_text("w")
    ck.publish(partial, path, {}, client_state={"run_id": run_id, "config": cfg.to_dict()})
    return path


def test_resume_refuses_another_architecture_or_batch_layout(tmp_path):
    path = _checkpoint(tmp_path, load_config(TINY))
    check_resume_fits(path, load_config(TINY), run_id="A")
    # memory knobs and the step budget may change
    check_resume_fits(
        path,
        load_config(TINY, ["batch.micro_batch_size=16", "train.rl_steps=900"]),
        run_id="A",
    )
    wider = load_config(TINY, ["model.hf_config.hidden_size=256"])
    with pytest.raises(ConfigError) as info:
        check_resume_fits(path, wider, run_id="A")
    assert "model.hf_config: checkpoint {" in str(info.value)
    assert "'hidden_size': 128" in str(info.value) and "'hidden_size': 256" in str(info.value)
    more = load_config(
        TINY, ["batch.samples_per_prompt=16", "batch.samples_per_optimizer_step=256"]
    )
    with pytest.raises(ConfigError) as info:
        check_resume_fits(path, more, run_id="A")
    msg = str(info.value)
    assert "batch.samples_per_prompt: checkpoint 8, now 16" in msg
    assert "batch.samples_per_optimizer_step: checkpoint 128, now 256" in msg
    async_path = _checkpoint(tmp_path / "async", load_config(TINY, ["train.max_staleness=2"]))
    with pytest.raises(ConfigError, match=r"train.max_staleness: checkpoint 2, now 1"):
        check_resume_fits(async_path, load_config(TINY, ["train.max_staleness=1"]), run_id="A")
    with pytest.raises(ConfigError, match=r"was written by run A, but logging\.run_dir belongs"):
        check_resume_fits(path, load_config(TINY), run_id="B")
