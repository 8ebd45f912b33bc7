"""Saved states and sampler weights under ``state_dir``, addressed by ``tinker://`` paths:

    tinker://<model_id>/weights/<name>          save_state: checkpoint (adapter + optimizer)
                                                and the adapter as a PEFT folder
    tinker://<model_id>/sampler_weights/<name>  save_weights_for_sampler: merged HF weights
                                                (serve.sampling: sampler), or the adapter as
                                                a PEFT folder and its fingerprint (vllm)

Each is written into ``<name>.partial`` and renamed when complete, so a server killed while
saving leaves the last complete state as it was, and a restarted server (same ``state_dir``)
loads it: a ``.partial`` folder is never read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from unirl.serve.errors import BadRequest

SCHEME = "tinker://"
KINDS = ("weights", "sampler_weights")
META = "meta.json"
CHECKPOINT = "checkpoint"  # the backend's checkpoint (weights and optimizer state)
HF = "hf"  # the merged weights as a Hugging Face folder (what the sampler loads)
ADAPTER = "adapter"  # the adapter as a PEFT folder (a weights-only load starts from it)


def sampled_weights(folder: Path, sampling: str) -> Path:
    """What a sampling session on the sampler weights in ``folder`` samples from: the merged
    Hugging Face folder (``serve.sampling: sampler``), or the folder itself (vllm: its adapter
    and the fingerprint in its meta)."""
    return folder if sampling == "vllm" else folder / HF


@attrs.frozen(kw_only=True)
class StatePath:
    model_id: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.model_id}/{self.kind}/{self.name}"

    def folder(self, state_dir: str | Path) -> Path:
        return Path(state_dir) / self.model_id.replace(":", "_") / self.kind / self.name


def parse_path(uri: str, field: str = "path") -> StatePath:
    parts = uri[len(SCHEME) :].split("/") if uri.startswith(SCHEME) else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise BadRequest(
            field,
            f"is {uri!r}; expected tinker://<model_id>/weights/<name> or "
            "tinker://<model_id>/sampler_weights/<name> as save_state / "
            "save_weights_for_sampler returned it",
        )
    return StatePath(model_id=parts[0], kind=parts[1], name=parts[2])


def check_name(name: str, field: str = "path") -> str:
    if not name or "/" in name or name.startswith(".") or name.endswith(".partial"):
        raise BadRequest(field, f"is {name!r}; a name is one path segment, no '/', no leading '.'")
    return name


def read_meta(folder: Path, field: str = "path") -> dict[str, Any]:
    meta = folder / META
    if not meta.is_file():
        raise BadRequest(field, f"names {folder.name!r}, which was never completely saved here")
    return dict(json.loads(meta.read_text()))


class PartialWrite:
    """``with PartialWrite(final) as tmp:`` fill ``tmp``; on success it becomes ``final``.

    Under torchrun every rank enters it (each writes its shards into ``tmp``); ``rank`` 0 makes
    and renames the folder, ``barrier`` (every rank) comes after making it and before renaming."""

    def __init__(
        self, final: Path, rank: int = 0, barrier: Callable[[], None] | None = None
    ) -> None:
        self.final, self.rank, self._barrier = final, rank, barrier
        self.tmp = final.with_name(final.name + ".partial")

    def __enter__(self) -> Path:
        if self.rank == 0:
            shutil.rmtree(self.tmp, ignore_errors=True)  # left by a server killed mid-save
            self.tmp.mkdir(parents=True)
        if self._barrier is not None:
            self._barrier()
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None and self._barrier is not None:
            self._barrier()  # every rank's part is written
        if self.rank != 0:
            return
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = self.final.with_name(self.final.name + ".old")
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        shutil.rmtree(old, ignore_errors=True)
