"""The rows of a prompt dataset (``rollout.prompts``), whatever it is stored as:

- a JSONL file (any name but ``*.parquet``): one JSON object per line, blank lines skipped; a
  row is named ``FILE line N`` (1-based, as an editor counts);
- a Parquet file (``*.parquet``, read with pyarrow): a row is named ``FILE row N``, N counted
  from 0 as ``table.slice(N, 1)`` and ``dataset[N]`` count;
- a Hugging Face ``datasets`` folder written by ``Dataset.save_to_disk`` (read with
  ``datasets.load_from_disk``), or a ``DatasetDict`` folder with one split; with several
  splits, name the split's subfolder (``FOLDER/train``).

Why one reader for all: datasets ship as Parquet (or as ``datasets`` folders) with their own
column names, and the checks that name a row and its field (`unirl.rollouts.data.prompts`) must hold
whatever the file is. A columnar format cannot leave a field out of one row: a null there
reads as the field being absent.

`content_digest` identifies the data (a checkpoint records it: resuming on other data warns).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from unirl.core.errors import ConfigError, RolloutDataError

KEY = "rollout.prompts"
PARQUET_SUFFIXES = (".parquet", ".pq")


def dataset_kind(path: Path) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"datasets"``; `ConfigError` when there is nothing to read."""
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return "datasets"
        raise ConfigError(
            f"{KEY}={str(path)!r} is a folder but not a Hugging Face datasets folder (no "
            "dataset_info.json or dataset_dict.json: write one with Dataset.save_to_disk); give "
            "a datasets folder, a Parquet file or a JSONL file"
        )
    if not path.is_file():
        raise ConfigError(
            f"{KEY}={str(path)!r} does not exist or is not a file; give the path of a "
            'JSONL prompt file (one {"prompt": ..., "metadata": {...}} object per line), a '
            "Parquet file or a Hugging Face datasets folder"
        )
    return "parquet" if path.suffix.lower() in PARQUET_SUFFIXES else "jsonl"


def iter_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    """``(where, number, row)`` of every row: ``where`` names it in errors (``FILE line N`` or
    ``FILE row N``), ``row`` is the parsed object (a dict unless the JSON line holds another
    value, which the caller refuses)."""
    kind = dataset_kind(path)
    if kind == "jsonl":
        yield from _jsonl_rows(path)
        return
    rows = _parquet_rows(path) if kind == "parquet" else _dataset_rows(path)
    for number, row in enumerate(rows):
        # A column cannot be absent from one row: null means "not given".
        given = TableRow({k: v for k, v in row.items() if v is not None})
        given.nulls = frozenset(k for k, v in row.items() if v is None)
        yield f"{path} row {number}", number, given


class TableRow(dict):
    """A Parquet or datasets row without its null cells, which it remembers (``nulls``): a
    mapped column that is null in one row is an empty cell to fill, not a wrong column name."""

    nulls: frozenset[str] = frozenset()


def _jsonl_rows(path: Path) -> Iterator[tuple[str, int, Any]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(raw)
            except ValueError as err:
                raise RolloutDataError(
                    f"{where}: not valid JSON ({err}); write one JSON object per line"
                ) from None
            yield where, number, row


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{KEY}={str(path)!r} is a Parquet file but pyarrow is not installed; pip install "
            "-e '.[datasets]' (or pyarrow), or write the prompts as JSONL"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's errors for a damaged or non-Parquet file vary
        raise RolloutDataError(
            f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc}); write it "
            "with pyarrow / pandas / datasets, or give a JSONL file"
        ) from None
    return table.to_pylist()


def _dataset_rows(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{KEY}={str(path)!r} is a Hugging Face datasets folder but `datasets` is not "
            "installed; pip install -e '.[datasets]'"
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if len(splits) != 1:
            raise ConfigError(
                f"{KEY}={str(path)!r} holds the splits {splits}; name one, e.g. "
                f"{KEY}: {path / splits[0]}"
            )
        loaded = loaded[splits[0]]
    return loaded


def content_digest(path: Path) -> str:
    """SHA-256 of the file, or of a folder's files (their relative names and bytes, sorted)."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
