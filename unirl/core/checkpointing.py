"""Checkpoint directories of a run: naming, the completeness marker, finding the newest complete
one, and pruning. The backend writes the contents (model, optimizer, scheduler, RNG); this module
only decides where, and marks a checkpoint complete after every rank has finished writing, so a
crash mid-save never leaves a directory that resume would pick."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: Path, rl_step: int) -> Path:
    return root / f"step_{rl_step:07d}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def mark_complete(path: Path) -> None:
    (path / COMPLETE_MARKER).write_text("ok\n")


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
    """Delete all but the newest `keep` complete checkpoints (and incomplete ones older than the
    newest complete one: leftovers of crashed saves). Returns what was removed."""
    found = complete_checkpoints(root)
    removed = []
    for _, path in found[:-keep] if keep > 0 else found:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    newest = found[-1][0] if found else None
    if newest is not None and root.is_dir():
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and int(match.group(1)) < newest and not is_complete(child):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
    for path in removed:
        logger.info("removed old checkpoint %s", path)
    return removed
