"""A run directory belongs to one run.

``logging.run_dir`` holds a run's ``config.yaml``, ``metrics.jsonl``, ``run.json`` (its run id),
TensorBoard events, the Hugging Face export and, by default, its checkpoints. A second run started
in the same directory would truncate the first one's metrics, and its pruning and ``--resume``
would mix the two runs' checkpoints. So, before any work:

- `check_writable` creates the directories and writes a probe file in each: a directory that
  cannot be written is found now, not at the first checkpoint after the work;
- `claim` refuses a directory that holds another run unless the user said ``--resume`` (continue
  it) or ``--overwrite`` (replace it), and returns the id of the run being resumed;
- `clear_previous_run` deletes what the old run left (``--overwrite`` only), and
  `write_run_id` records this run's id, which every checkpoint marker also carries.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from unirl.core.errors import ConfigError
from unirl.core.run import checkpointing

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
# What a run writes into its directory (checkpoints are looked for under the checkpoint root).
RUN_ARTIFACTS = ("run.json", "config.yaml", "metrics.jsonl", "tensorboard", "wandb", "hf")


def new_run_id() -> str:
    return uuid.uuid4().hex


def check_writable(path: Path, key: str) -> None:
    """Create `path` and write (then remove) a probe file there; `key` names the config key."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".unirl_write_probe.{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"{key}={str(path)!r} is not a writable directory ({exc.strerror or exc}); choose a "
            "directory you can write, or fix its permissions, before starting the run"
        ) from None


def read_run_id(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _previous(run_dir: Path, ckpt_root: Path) -> list[str]:
    """What an earlier run left that a new run would clobber."""
    found = [name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    if ckpt_root.is_dir() and any(
        checkpointing.step_number(child.name) is not None for child in ckpt_root.iterdir()
    ):
        found.append(str(ckpt_root))
    return found


def claim(run_dir: Path, ckpt_root: Path, *, resume: bool, overwrite: bool) -> str | None:
    """The id of the run to continue (resume), or None for a new run. Read-only: every rank can
    call it. Raises `ConfigError` when a new run would reuse another run's directory."""
    if resume and overwrite:
        raise ConfigError(
            "--resume continues the run in logging.run_dir and --overwrite deletes it; give one"
        )
    if resume:
        if not _previous(run_dir, ckpt_root):
            raise ConfigError(
                f"--resume: logging.run_dir={str(run_dir)!r} holds no run to continue (no "
                f"{RUN_FILE}, metrics or checkpoint under {str(ckpt_root)!r}); check the "
                "directory (and checkpoint.dir), or drop --resume to start a new run"
            )
        run_id = read_run_id(run_dir)
        if run_id is None:
            latest = checkpointing.latest_complete(ckpt_root)
            run_id = checkpointing.run_info(latest[1]).get("run_id") if latest else None
        return run_id
    previous = _previous(run_dir, ckpt_root)
    if previous and not overwrite:
        raise ConfigError(
            f"logging.run_dir={str(run_dir)!r} already holds a run ({', '.join(previous)}); "
            "pass --resume to continue it, --overwrite to delete it and start again, or set "
            "logging.run_dir to a new directory"
        )
    return None


def clear_previous_run(run_dir: Path, ckpt_root: Path) -> list[Path]:
    """``--overwrite``: delete the old run's files and checkpoints (one rank, before any work)."""
    removed = [run_dir / name for name in RUN_ARTIFACTS if (run_dir / name).exists()]
    if ckpt_root.is_dir():
        removed += [
            child
            for child in ckpt_root.iterdir()
            if checkpointing.step_number(child.name) is not None
        ]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if removed:
        logger.warning("--overwrite: deleted the previous run's %s", ", ".join(map(str, removed)))
    return removed


def write_run_id(run_dir: Path, run_id: str) -> None:
    tmp = run_dir / f"{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id}) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)
