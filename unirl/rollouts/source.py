"""Where a run's rollouts come from: one interface, a plug-in per source
(`unirl.core.protocols.source_plugin`; the built-ins are ``sampler``, ``file`` and ``vllm``).

`RolloutSource` is what the training loop calls once per RL step. `FileRolloutSource` cuts a
file of samples written by another engine (JSONL; Parquet when pyarrow is installed) into
rollouts of ``batch.prompts_per_rollout x batch.samples_per_prompt`` samples, in file order;
`unirl.rollouts.sampler_source.SamplerRolloutSource` generates them with the current policy,
`unirl.rollouts.vllm.VllmRolloutSource` with a vLLM engine that follows the policy's weights.

    source = FileRolloutSource("rollouts.jsonl", rollout_size=128)
    source.num_rollouts           # full rollouts in the file
    batch = source.next_rollout(rl_step=0)
    state = source.state_dict()   # saved with a checkpoint; load_state_dict continues from there

The file is scanned once for where each rollout starts and read one rollout at a time, so a
large file is never held in memory. Records are type-checked while read (errors name the file
and line); the runner still calls `RolloutBatch.validate` on every batch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.progress.bars import GenerationProgress
from unirl.core.weights.stream import HOST, Bucket, drain

logger = logging.getLogger(__name__)

PARQUET_SUFFIXES = (".parquet", ".pq")


@runtime_checkable
class RolloutSource(Protocol):
    """Produces one `RolloutBatch` per RL step and follows the policy's weights.

    ``num_rollouts`` is how many rollouts the source can produce (None: unlimited);
    ``vocab_size`` is the size of the vocabulary its token ids come from (None: unknown, e.g. a
    file). ``state_dict`` / ``load_state_dict`` carry the stream position (RNG states, file
    position) through a checkpoint, so a resumed run sees the rollouts it would have seen.
    ``close`` releases what the source started (an engine's processes).
    ``next_rollout`` reports finished samples and generated tokens to ``progress`` (the
    generation bar the training loop opens, `GenerationProgress`) when one is given.

    Weights. ``sync_weights`` gets the policy's weights as a stream of buckets of Hugging
    Face-named tensors (`unirl.core.weights.stream`; on the ranks the plug-in's ``weights``
    names, an empty stream elsewhere) and must run it to its end on every rank, also when it
    fails (`unirl.core.weights.stream.drain`): the stream's gathers are collective. The tensors
    are on ``weights_device``, which the source names (the training loop asks the backend for
    buckets there): the host (`unirl.core.weights.stream.HOST`) for a file reload or a sampler,
    the GPU for a transport that sends GPU memory as it is. A source must also take buckets on
    the host from elsewhere (`as_buckets` of a snapshot, `unirl.rollouts.async_source`).

    Policy versions. ``sync_weights`` hands over the policy's weights with their
    ``policy_version`` (the optimizer steps the policy has taken); every sample a source hands
    out carries the version of the weights that generated it (`RolloutSample.policy_version`),
    None where unknown. Today's generating sources hand out the version of the last sync (they
    are on-policy); a source that generates ahead (asynchronously, or on several engines synced
    at different times) hands out older versions and says which, sample by sample, and the
    training loop records how stale each rollout is (`policy_version_metrics`).
    """

    @property
    def num_rollouts(self) -> int | None: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def weights_device(self) -> torch.device: ...

    def next_rollout(
        self, rl_step: int, progress: GenerationProgress | None = None
    ) -> RolloutBatch: ...

    def sync_weights(self, buckets: Iterable[Bucket], *, policy_version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None:
        """Release what the source started (an engine's processes); the run calls it last,
        also after an error."""
        ...


@runtime_checkable
class MeasuresRollouts(Protocol):
    """A source that knows more of a rollout than its samples say (a wrapper generating ahead in
    a worker: its staleness, the worker's seconds); the training loop logs `rollout_metrics`
    with the step that trains the rollout handed out last, over its own keys of the same name."""

    def rollout_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class UsesWeightsHere(Protocol):
    """A source whose ranks do not all use the weights they receive (several vLLM engines:
    every rank receives the stream, only the engines' leaders send it on). A source without it
    uses them on every rank that receives them."""

    def uses_weights_here(self) -> bool:
        """Whether this rank sends the weights it receives on (to its engine); the others only
        run the stream's collectives. Makes no collective call."""
        ...


@runtime_checkable
class ChecksTrainerFit(Protocol):
    """A source whose engine shares the trainer's GPUs and checks, after the trainer's first RL
    step, that the trainer's measured peak and the engine's memory fit them
    (`unirl.rollouts.vllm.fit`). Collective: every rank calls it at the same point."""

    def check_trainer_fit(self) -> None: ...


def uses_weights_here(source: RolloutSource) -> bool:
    """`UsesWeightsHere.uses_weights_here`, True for a source without it."""
    return source.uses_weights_here() if isinstance(source, UsesWeightsHere) else True


def policy_version_metrics(batch: RolloutBatch, trainer_version: int) -> dict[str, float]:
    """How old the rollout is: ``rollout/policy_version``, the oldest version among its samples,
    and ``rollout/staleness``, how many optimizer steps the trained weights (``trainer_version``)
    are ahead of it (0: on-policy). Empty when no sample says its version (a file without them)."""
    versions = [s.policy_version for s in batch.samples if s.policy_version is not None]
    if not versions:
        return {}
    oldest = min(versions)
    return {
        "rollout/policy_version": float(oldest),
        "rollout/staleness": float(trainer_version - oldest),
    }


# -- readers: a file of records, read one rollout at a time ---------------------------------


class _JsonlReader:
    """Byte offsets of every rollout's first line, found by one scan of the file."""

    unit = "line"

    def __init__(self, path: Path, rollout_size: int) -> None:
        self.path, self.rollout_size = path, rollout_size
        self.starts: list[tuple[int, int]] = []  # (byte offset, line number) per rollout
        self.count = 0
        self.last_location = 0  # line number of the last record
        self.leftover_location = 0  # line number of the first record that fills no rollout
        offset = 0
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    if self.count % rollout_size == 0:
                        self.starts.append((offset, line_number))
                    self.count += 1
                    self.last_location = line_number
                offset += len(line)
        if self.count % rollout_size:
            self.leftover_location = self.starts.pop()[1]

    def read(self, index: int) -> tuple[list[RolloutSample], list[str]]:
        """The samples of rollout `index` and where each one is ("FILE line N")."""
        offset, line_number = self.starts[index]
        samples: list[RolloutSample] = []
        origins: list[str] = []
        with open(self.path, "rb") as f:
            f.seek(offset)
            while len(samples) < self.rollout_size:
                line = f.readline()
                assert line, "the scan counted more records than the file holds"
                if line.strip():
                    samples.append(self._parse(line, line_number))
                    origins.append(f"{self.path} line {line_number}")
                line_number += 1
        return samples, origins

    def _parse(self, line: bytes, line_number: int) -> RolloutSample:
        where = f"{self.path} line {line_number}"
        try:
            record = json.loads(line)
        except ValueError as err:  # bad JSON, bad UTF-8, an integer past Python's digit limit
            raise RolloutDataError(
                f"{where}: not valid JSON ({err}); write one JSON object per line"
            ) from None
        try:
            return RolloutSample.from_record(record)
        except RolloutDataError as err:
            raise RolloutDataError(f"{where}: {err}") from None


class _ParquetReader:
    """Rows of a Parquet file (one sample per row, columns named like the JSONL fields)."""

    unit = "row"

    def __init__(self, path: Path, rollout_size: int) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"rollout.file={str(path)!r} is a Parquet file but pyarrow is not installed; "
                "pip install pyarrow, or write the rollouts as JSONL"
            ) from None
        self.path, self.rollout_size = path, rollout_size
        self.table = pq.read_table(path, memory_map=True)
        self.count = self.table.num_rows
        full = self.count // rollout_size
        self.starts = [(i * rollout_size, i * rollout_size + 1) for i in range(full)]
        self.last_location = self.count
        self.leftover_location = full * rollout_size + 1 if self.count % rollout_size else 0

    def read(self, index: int) -> tuple[list[RolloutSample], list[str]]:
        first = index * self.rollout_size
        rows = self.table.slice(first, self.rollout_size).to_pylist()
        samples = []
        for i, row in enumerate(rows):
            try:
                samples.append(RolloutSample.from_record(row))
            except RolloutDataError as err:
                raise RolloutDataError(f"{self.path} row {first + i + 1}: {err}") from None
        origins = [f"{self.path} row {first + i + 1}" for i in range(len(samples))]
        return samples, origins


# -- the file source -------------------------------------------------------------------------


class FileRolloutSource:
    """Rollouts read in file order, ``rollout_size`` samples each; ``sync_weights`` is a no-op
    (the file was sampled by another engine, possibly from older weights)."""

    def __init__(self, path: str | os.PathLike[str], *, rollout_size: int) -> None:
        if rollout_size < 1:
            raise ConfigError(f"FileRolloutSource: rollout_size must be >= 1, got {rollout_size}")
        self.path = Path(path)
        self.rollout_size = rollout_size
        if not self.path.is_file():
            raise ConfigError(
                f"rollout.file={str(self.path)!r} does not exist or is not a file; give the path "
                "of a JSONL (or Parquet) rollout file"
            )
        parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
        reader_cls = _ParquetReader if parquet else _JsonlReader
        self._reader = reader_cls(self.path, rollout_size)
        self._next = 0
        self._check_size()

    def _check_size(self) -> None:
        r, size = self._reader, self.rollout_size
        if not r.starts:
            where = f"{self.path} {r.unit} {r.last_location}" if r.count else str(self.path)
            raise RolloutDataError(
                f"{where}: the file ends after {r.count} samples, fewer than one rollout of "
                f"{size} (batch.prompts_per_rollout x batch.samples_per_prompt), so it holds 0 "
                f"rollouts; write at least {size} samples or lower those sizes"
            )
        if r.leftover_location:
            logger.warning(
                "%s: %d samples from %s %d on do not fill a rollout of %d and are not used",
                self.path,
                r.count % size,
                r.unit,
                r.leftover_location,
                size,
            )

    @property
    def num_rollouts(self) -> int:
        return len(self._reader.starts)

    @property
    def vocab_size(self) -> None:
        return None

    def next_rollout(
        self, rl_step: int, progress: GenerationProgress | None = None
    ) -> RolloutBatch:
        r = self._reader
        if self._next >= self.num_rollouts:
            raise RolloutDataError(
                f"{self.path} {r.unit} {r.last_location}: the file ends; it holds "
                f"{self.num_rollouts} rollouts of {self.rollout_size} samples and all were used "
                f"before rl_step {rl_step}. Lower train.rl_steps to {self.num_rollouts} or "
                "write more rollouts"
            )
        samples, origins = r.read(self._next)
        self._next += 1
        if progress is not None:  # samples read (a file generates no tokens)
            progress.update(samples=len(samples))
        return RolloutBatch(tuple(samples), origins=tuple(origins))

    @property
    def weights_device(self) -> torch.device:
        return HOST  # never streamed to (the plug-in needs no weights)

    def sync_weights(self, buckets: Iterable[Bucket], *, policy_version: int) -> None:
        """Nothing to update: the file's samples are fixed (their versions are the records').
        The training loop never calls it (the plug-in needs no weights)."""
        drain(buckets)

    def close(self) -> None:
        """Nothing to release: the file is opened per rollout."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "source": "file",
            "path": str(self.path),
            "rollout_size": self.rollout_size,
            "next_rollout": self._next,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("source") != "file":
            raise ConfigError(
                f"the checkpoint's rollout state is from source {state.get('source')!r}, but "
                "rollout.source is 'file'; resume with the rollout source the run started with"
            )
        if state["rollout_size"] != self.rollout_size:
            raise ConfigError(
                f"the checkpoint read rollouts of {state['rollout_size']} samples, this config "
                f"asks for {self.rollout_size} (batch.prompts_per_rollout x "
                "batch.samples_per_prompt); resume with the sizes the run started with"
            )
        if state["path"] != str(self.path):
            logger.warning(
                "resuming rollouts from %s at rollout %d; the checkpoint read %s",
                self.path,
                state["next_rollout"],
                state["path"],
            )
        if not 0 <= state["next_rollout"] <= self.num_rollouts:
            raise RolloutDataError(
                f"{self.path}: the checkpoint continues at rollout {state['next_rollout']} but the "
                f"file holds {self.num_rollouts} rollouts of {self.rollout_size} samples"
            )
        self._next = int(state["next_rollout"])
