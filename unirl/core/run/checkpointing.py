"""Checkpoint directories of a run, shared by every backend.

A backend writes a checkpoint into ``<path>.partial`` (model, optimizer, scheduler, its ranks'
RNG states), then, once every rank is done, rank 0 writes the ``complete`` marker (with what the
backend needs to refuse an incompatible resume) and renames the folder into place (`publish`).
So a directory named ``step_N`` with its marker is always whole; a crash leaves only a
``.partial`` that resume never picks. This module names the directories, finds the newest
complete one, prunes old ones, and holds the RNG capture both backends restore bit-exactly.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "complete"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, rl_step: int) -> Path:
    return root / f"step_{rl_step:07d}"


def partial_dir(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def publish(partial: Path, path: Path, meta: Mapping[str, Any]) -> None:
    """Rank 0, after every rank has written into `partial`: write the marker (synced to disk),
    then move the folder into place, replacing an older checkpoint of the same name."""
    with open(partial / COMPLETE_MARKER, "w") as handle:
        json.dump(dict(meta), handle)
        handle.flush()
        os.fsync(handle.fileno())
    if path.exists():
        logger.warning("overwriting checkpoint %s", path)
        shutil.rmtree(path)
    os.replace(partial, path)


def read_marker(path: Path) -> dict[str, Any]:
    """The marker's metadata; a missing or unfinished checkpoint is a `ConfigError`."""
    marker = Path(path) / COMPLETE_MARKER
    if not marker.is_file():
        what = "does not exist" if not Path(path).exists() else f"has no '{COMPLETE_MARKER}' marker"
        raise ConfigError(
            f"checkpoint {str(path)!r} {what}: it was never written or was interrupted while "
            "being written; resume from another checkpoint"
        )
    return json.loads(marker.read_text())


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(rl_step, path) of every complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_complete(root: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and ``.partial`` leftovers of
    crashed saves older than the newest complete one. Returns what was removed."""
    found = complete_checkpoints(root)
    removed = [path for _, path in (found[:-keep] if keep > 0 else found)]
    newest = found[-1][0] if found else None
    if newest is not None:
        for child in root.iterdir():
            match = re.match(r"^step_(\d+)\.partial$", child.name)
            if match and int(match.group(1)) < newest:
                removed.append(child)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed old checkpoint %s", path)
    return removed


def rng_state() -> dict[str, Any]:
    """Python, torch (CPU and CUDA) and numpy RNG states of this process."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
