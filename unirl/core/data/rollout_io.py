"""Rollouts as JSONL files: one JSON object per line, one line per sample.

The format is how an external rollout engine (vLLM, SGLang, a script) hands samples to training
and how a run keeps the rollouts it trained on. Fields are those of `RolloutSample`:

    {"prompt_tokens": [1, 15], "response_tokens": [7, 2], "reward": 1.0, "group_id": 0,
     "loss_mask": [1, 1], "rollout_logprobs": [-0.3, -0.01], "metadata": {"source": "gsm8k"}}

``prompt_tokens``, ``response_tokens``, ``reward`` and ``group_id`` are required; ``loss_mask``
(default all ones), ``rollout_logprobs``, ``ref_logprobs``, ``values``, ``token_rewards`` (the
part of ``reward`` earned at each response token, for the token-level estimators; ``reward``
stays the total) and ``metadata`` are optional. Blank lines are skipped. Reading checks types only: call `RolloutBatch.validate`
afterwards (its "sample i" is the i-th record, counting from 0). Non-finite floats are written
as Python's JSON does (``NaN``, ``Infinity``) so that a broken batch can be saved for a look.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.errors import RolloutDataError


def read_rollouts(path: str | os.PathLike[str]) -> RolloutBatch:
    """Read a JSONL rollout file; a bad line raises `RolloutDataError` naming the file, the
    line number (from 1) and the field."""
    samples, origins = [], []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise RolloutDataError(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno}); write one JSON "
                    "object per line"
                ) from None
            except ValueError as err:  # e.g. an integer past Python's digit limit
                raise RolloutDataError(
                    f"{where}: not valid JSON ({err}); write numbers as JSON numbers of "
                    "ordinary size"
                ) from None
            try:
                samples.append(RolloutSample.from_record(record))
            except RolloutDataError as err:
                raise RolloutDataError(f"{where}: {err}") from None
            origins.append(where)
    return RolloutBatch(tuple(samples), origins=tuple(origins))


def write_rollouts(
    path: str | os.PathLike[str], samples: RolloutBatch | Iterable[RolloutSample]
) -> None:
    """Write samples as JSONL, one line each, in order."""
    if isinstance(samples, RolloutBatch):
        samples = samples.samples
    with open(path, "w", encoding="utf-8") as f:
        for i, sample in enumerate(samples):
            try:
                line = json.dumps(sample.to_record())
            except (TypeError, ValueError) as err:
                raise RolloutDataError(
                    f"sample {i}: field 'metadata' cannot be written as JSON ({err}); keep "
                    "metadata to str keys and JSON values (str, number, bool, None, list, dict)"
                ) from None
            f.write(line + "\n")
