"""Whether a checkpoint fits the run that resumes from it, checked before anything is loaded.

A checkpoint of another architecture fails deep inside a backend's load with a shape traceback;
one written with other batch sizes loads fine and then silently runs another experiment (the
rollout stream, the LR schedule and the optimizer-step count all depend on them). Both are
refused here, naming every key that differs (the async queue's depth too: the checkpoint
holds that many rollouts generated ahead). Memory knobs (microbatch sizes), the step budget,
the learning rate and everything else may change on resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unirl.core.config.run_config import UnirlConfig
from unirl.core.errors import ConfigError
from unirl.core.run import checkpointing

# Keys whose value must be the same as when the checkpoint was written.
MUST_MATCH = (
    "backend",
    "model.path",
    "model.hf_config",
    "model.dtype",
    "batch.prompts_per_rollout",
    "batch.samples_per_prompt",
    "batch.samples_per_optimizer_step",
    "batch.epochs_per_rollout",
    # the rollouts generated ahead that the checkpoint holds: fewer slots would drop some
    # (their prompts never trained on), more would leave the queue short
    "train.max_staleness",
)


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for key in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def check_resume_fits(path: Path, cfg: UnirlConfig, *, run_id: str | None) -> None:
    """Raise `ConfigError` if checkpoint `path` was written by another run or with another
    architecture or batch layout than `cfg`."""
    info = checkpointing.run_info(path)
    owner = info.get("run_id")
    if run_id is not None and owner is not None and owner != run_id:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written by run {owner}, but logging.run_dir belongs "
            f"to run {run_id}; point checkpoint.dir at this run's checkpoints"
        )
    saved = info.get("config")
    if not isinstance(saved, Mapping):
        return  # written before configs were recorded in the marker
    now = cfg.to_dict()
    diffs = [
        f"{key}: checkpoint {_get(saved, key)!r}, now {_get(now, key)!r}"
        for key in MUST_MATCH
        if _get(saved, key) != _get(now, key)
    ]
    if diffs:
        raise ConfigError(
            f"--resume: checkpoint {str(path)!r} does not fit this config ("
            + "; ".join(diffs)
            + "); resume with the values the run started with, or start a new run in another "
            "logging.run_dir"
        )
