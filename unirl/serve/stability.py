"""What ``stable_reinforce`` trains on besides the datum: the sampling record of each sequence
sampled with ``record_stability_info=True`` (its request's prompt, its sampled tokens and the
sampler's log-prob of each), named by the ``sequence_id`` the SDK stamps on it, and the datum's
provenance (``Datum.with_provenance``) resolved against those records into per-position values.

Resolving checks every claim: the runs tile their field, each names a recorded sequence and
positions it has, and the datum's tokens are the recorded ones at the claimed positions (over the
targets, at the sampled ones: the cookbook pads prompt targets with 0); a wrong claim is a `BadRequest`
naming the datum and the run, raised before the request is queued. What comes out is values
(which targets were sampled, and the sampler's log-prob of each): the loss needs no record.

Records live on the serving rank, in memory: Tinker keeps a sequence trainable for a day after
sampling, each training request that uses it restarting the day; the oldest go first past
`KEPT_SEQUENCES` (a later reference to one is refused, naming it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from unirl.serve.errors import BadRequest
from unirl.serve.wire import WireSpan, decode_sample_sequences

RECORD_TTL_S = 86400.0
KEPT_SEQUENCES = 65536


def sequence_id(request_id: str, index: int) -> str:
    """The id of the ``index``-th sequence a sample request returned (``SampledSequence.
    sequence_id``; the server answers them with the request's future)."""
    return f"{request_id}/{index}"


@attrs.frozen(kw_only=True)
class SampledRecord:
    prompt: np.ndarray  # [P] int64: the request's prompt
    tokens: np.ndarray  # [S] int64: this sequence's sampled tokens
    logprobs: np.ndarray  # [S] float32: the sampler's log-prob of each


class StabilityRecords:
    """``sequence_id`` -> `SampledRecord`, least recently used first; thread-safe (the worker
    records, the HTTP handlers read)."""

    def __init__(self) -> None:
        self._records: OrderedDict[str, tuple[SampledRecord, float]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, request_id: str, prompt: Sequence[int], response: bytes) -> None:
        """Keep every sequence of one sample request's ``SampleResponse`` (protobuf)."""
        prompt_np = np.asarray(prompt, dtype=np.int64)
        now = time.monotonic()
        with self._lock:
            for i, (tokens, logprobs) in enumerate(decode_sample_sequences(response)):
                rec = SampledRecord(prompt=prompt_np, tokens=tokens, logprobs=logprobs)
                self._records[sequence_id(request_id, i)] = (rec, now)
            while len(self._records) > KEPT_SEQUENCES:
                self._records.popitem(last=False)

    def get(self, seq_id: str, field: str) -> SampledRecord:
        """The record, for checking a request: its day is restarted only by `touch`, once the
        whole request passed (a rejected request changes nothing)."""
        now = time.monotonic()
        with self._lock:
            found = self._records.get(seq_id)
            if found is None or now - found[1] > RECORD_TTL_S:
                self._records.pop(seq_id, None)
                raise BadRequest(
                    field,
                    f"is {seq_id!r}, which this server holds no sampling record of: sample with "
                    "record_stability_info=True (records last a day from their last use)",
                )
            return found[0]

    def touch(self, seq_ids: Iterable[str]) -> None:
        """A request that uses these records was accepted: each one's day starts again."""
        now = time.monotonic()
        with self._lock:
            for seq_id in seq_ids:
                found = self._records.get(seq_id)
                if found is not None:  # dropped past the cap meanwhile: its values are resolved
                    self._records[seq_id] = (found[0], now)
                    self._records.move_to_end(seq_id)


def resolve_spans(
    spans: Sequence[WireSpan],
    tokens: np.ndarray,
    field: str,
    records: StabilityRecords,
    *,
    check_prompt_tokens: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """The runs checked against the records and ``tokens`` (the field they tile): per position,
    whether it is a sampled token, and the sampler's log-prob there (0 where not sampled).
    A sampled run's tokens must be the recorded ones; a prompt run's only with
    ``check_prompt_tokens`` (the model input: over the targets, a prompt run only says the
    position was not sampled, and rl_loop pads those targets with 0)."""
    n = int(tokens.size)
    covered = sum(s.length for s in spans)
    if covered != n:
        raise BadRequest(field, f"covers {covered} positions; its runs must tile the field's {n}")
    sampled = np.zeros(n, dtype=bool)
    sampler_logprobs = np.zeros(n, dtype=np.float32)
    pos = 0
    for j, span in enumerate(spans):
        rec = records.get(span.sequence_id, f"{field}[{j}].sequence_id")
        source, what = (rec.tokens, "sampled tokens") if span.sampled else (rec.prompt, "prompt")
        end = span.offset + span.length
        if end > source.size:
            raise BadRequest(
                f"{field}[{j}]",
                f"claims positions [{span.offset}, {end}) of the {what} of {span.sequence_id!r}, "
                f"which has {source.size}",
            )
        claimed, held = tokens[pos : pos + span.length], source[span.offset : end]
        checked = span.sampled or check_prompt_tokens
        bad = np.flatnonzero(claimed != held) if checked else np.zeros(0, dtype=np.int64)
        if bad.size:
            k = int(bad[0])
            raise BadRequest(
                f"{field}[{j}]",
                f"claims token {int(claimed[k])} at position {pos + k}, but the {what} of "
                f"{span.sequence_id!r} hold {int(held[k])} there (position {span.offset + k})",
            )
        if span.sampled:
            sampled[pos : pos + span.length] = True
            sampler_logprobs[pos : pos + span.length] = rec.logprobs[span.offset : end]
        pos += span.length
    return sampled, sampler_logprobs
