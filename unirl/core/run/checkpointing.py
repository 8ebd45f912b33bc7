"""Checkpoint directories of a run, shared by every backend.

A backend writes a checkpoint into ``<path>.partial`` (model, optimizer, scheduler, its ranks'
RNG states), then, once every rank is done, rank 0 calls `publish`: it fsyncs every file, writes
the ``complete`` marker (what the backend needs to refuse an incompatible resume, the run's id and
config, and the size of every file), fsyncs it and renames the folder into place. So a crash
leaves only a ``.partial`` that resume never picks, and a checkpoint damaged after the fact (a
file truncated or lost) fails the size check: resume then falls back to the previous verified
checkpoint with a warning. Pruning deletes only the checkpoints of the run that asks (its run id
is in the marker). This module names the directories, finds the newest verified one, prunes,
and holds the RNG capture both backends restore bit-exactly.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
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
# The marker's own section (run id, config, file sizes); the rest is the backend's metadata.
_OWN_KEY = "unirl"


def step_dir(root: Path, rl_step: int) -> Path:
    return root / f"step_{rl_step:07d}"


def step_number(name: str) -> int | None:
    """The RL step of a checkpoint folder name (``step_N`` or a crashed ``step_N.partial``)."""
    match = re.match(r"^step_(\d+)(\.partial)?$", name)
    return int(match.group(1)) if match else None


def partial_dir(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files_and_sizes(folder: Path) -> dict[str, int]:
    return {
        str(f.relative_to(folder)): f.stat().st_size
        for f in sorted(folder.rglob("*"))
        if f.is_file() and f.name != COMPLETE_MARKER
    }


def publish(
    partial: Path, path: Path, meta: Mapping[str, Any], *, client_state: Mapping[str, Any]
) -> None:
    """Rank 0, after every rank has written into `partial`: sync every file to disk, write the
    marker (backend `meta`, the run id and config from `client_state`, every file's size),
    sync it, then move the folder into place, replacing an older checkpoint of the same name.
    Files first, marker last: a power cut can never leave a marker over unwritten data."""
    files = _files_and_sizes(partial)
    for name in files:
        _fsync_path(partial / name)
    for folder in {(partial / name).parent for name in files} | {partial}:
        _fsync_path(folder)  # the directory entries of the new files
    own = {
        "run_id": client_state.get("run_id"),
        "config": client_state.get("config"),
        "files": files,
    }
    with open(partial / COMPLETE_MARKER, "w") as handle:
        json.dump({**dict(meta), _OWN_KEY: own}, handle, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    if path.exists():
        logger.warning("overwriting checkpoint %s", path)
        shutil.rmtree(path)
    os.replace(partial, path)
    _fsync_path(path.parent)  # the rename itself


def _read_full_marker(path: Path) -> dict[str, Any]:
    marker = Path(path) / COMPLETE_MARKER
    if not marker.is_file():
        what = "does not exist" if not Path(path).exists() else f"has no '{COMPLETE_MARKER}' marker"
        raise ConfigError(
            f"checkpoint {str(path)!r} {what}: it was never written or was interrupted while "
            "being written; resume from another checkpoint"
        )
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"checkpoint {str(path)!r}: its '{COMPLETE_MARKER}' marker cannot be read ({exc}); "
            "the checkpoint is damaged: resume from another checkpoint"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"checkpoint {str(path)!r}: its marker is not a JSON object; damaged")
    return data


def read_marker(path: Path) -> dict[str, Any]:
    """The backend's metadata in the marker; a missing or unfinished checkpoint is a
    `ConfigError`."""
    data = _read_full_marker(path)
    data.pop(_OWN_KEY, None)
    return data


def run_info(path: Path) -> dict[str, Any]:
    """The run id and config the checkpoint was written by ({} for an older checkpoint)."""
    return dict(_read_full_marker(path).get(_OWN_KEY) or {})


def damage(path: Path) -> str | None:
    """Why a complete checkpoint cannot be trusted (a file missing or of another size than
    when it was written), or None when every recorded file is as written."""
    try:
        files = run_info(path).get("files")
    except ConfigError as exc:
        return str(exc)
    if files is None:
        return None  # written before sizes were recorded: nothing to check against
    for name, size in files.items():
        f = Path(path) / name
        if not f.is_file():
            return f"file {name} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written"
    return None


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
    """The newest complete checkpoint whose files are as written; a damaged newer one is
    skipped with a warning naming what is wrong (it stays on disk for a look)."""
    for step, path in reversed(complete_checkpoints(root)):
        why = damage(path)
        if why is None:
            return step, path
        logger.warning(
            "checkpoint %s is damaged (%s): falling back to the previous complete checkpoint",
            path,
            why,
        )
    return None


def owned_by(path: Path, run_id: str | None) -> bool:
    try:
        return run_info(path).get("run_id") == run_id
    except ConfigError:
        return False


def prune(root: Path, keep: int, run_id: str | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints of run `run_id` (checkpoints of
    any other run are never touched), and ``.partial`` leftovers of crashed saves older than
    its newest complete one. Returns what was removed."""
    found = [(s, p) for s, p in complete_checkpoints(root) if owned_by(p, run_id)]
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


def _numpy_rng_globals() -> list[Any]:
    """What numpy's RNG state (``np.random.get_state()``: a tuple holding a uint32 array)
    pickles as: the globals `load_state` allows beside torch's tensors and plain containers."""
    try:
        import numpy as np
    except ImportError:
        return []
    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_state(path: Path) -> Any:
    """A small state file of a checkpoint (the RNG states, a backend's metadata) read with
    ``torch.load(weights_only=True)``: tensors, numbers, strings and containers, and numpy's RNG
    array, but no pickled code. A checkpoint from elsewhere then cannot run code when it is
    resumed or converted; a file that needs more is refused with the name of what it holds."""
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ConfigError(
                f"checkpoint file {str(path)!r} holds objects other than tensors, numbers and "
                f"containers, which unirl does not unpickle ({str(exc).splitlines()[0]}); it was "
                "not written by unirl, or was altered"
            ) from None
