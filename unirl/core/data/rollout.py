"""The rollout data contract: what a rollout engine hands to training, checked before anything runs.

A `RolloutSample` is one prompt and one sampled response with its reward and group (the prompt it
answers; GRPO normalises rewards within a group). Optional per-response-token fields carry what
the engine or a reference model already computed: the sampling log-probs (`rollout_logprobs`,
for off-policy correction and for skipping the old-log-prob forward), reference log-probs
(`ref_logprobs`, for the KL penalty) and critic values (`values`, for GAE). `policy_version` is
the optimizer-step count of the policy weights that generated the response (None: unknown, e.g. a
file written elsewhere); a source that hands out rollouts of older weights says so with it.

`RolloutBatch.validate` finds every broken sample *before* a forward runs, because a bad token id
or a NaN log-prob deep inside a training step shows up as an opaque CUDA assert or a NaN loss
minutes later. Each problem names the sample index, the field, the value seen and what to do.

Token layout. Per-token fields of a packed microbatch are aligned with the tokens themselves:
position ``j`` holds the mask / log-prob of ``tokens[j]``, which the model predicts from the logits
at ``j - 1``. Every prompt has at least one token, so a response token never starts a sequence.

    batch = RolloutBatch.from_records(records)
    batch.validate(vocab_size=151_936, max_seq_len=4096, samples_per_prompt=8)
    mb = batch.pack([3, 0, 7])  # flat tokens, cu_seqlens, position ids, masks for one microbatch
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import RolloutDataError

# A log-prob above this is not a log-prob (probabilities or logits passed by mistake); the slack
# absorbs the rounding of a log-softmax whose true value is 0.
LOGPROB_TOLERANCE = 1e-6

REQUIRED_FIELDS = ("prompt_tokens", "response_tokens", "reward", "group_id")
OPTIONAL_FIELDS = (
    "loss_mask",
    "rollout_logprobs",
    "ref_logprobs",
    "values",
    "policy_version",
    "metadata",
)
# Optional float fields with one entry per response token; each is given for all samples or none.
PER_TOKEN_FLOAT_FIELDS = ("rollout_logprobs", "ref_logprobs", "values")
LOGPROB_FIELDS = ("rollout_logprobs", "ref_logprobs")

# What a per-token field holds, for "give one ... per response token".
_PER_TOKEN_WHAT = {
    "loss_mask": "0/1 entry",
    "rollout_logprobs": "log-prob",
    "ref_logprobs": "log-prob",
    "values": "value estimate",
}

_MAX_LISTED_PROBLEMS = 20


# -- converters: normalise one field's value or raise naming the field ------------------------


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str() (4300 digits by default)
        return f"{type(value).__name__} of {value.bit_length()} bits"
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _first_bad_element(
    field: str, value: Sequence[Any], ok: Callable[[Any], bool], want: str
) -> RolloutDataError:
    for j, v in enumerate(value):
        if not ok(v):
            return RolloutDataError(f"field '{field}' element {j} is {_describe(v)}; {want}")
    return RolloutDataError(f"field '{field}' could not be read as a list; {want}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _fits_int64(v: Any) -> bool:
    return _is_int(v) and -(2**63) <= v < 2**63


def _is_finite_float(v: Any) -> bool:
    """A real number that float() can hold: a huge JSON integer (1e400 written as digits) would
    raise OverflowError deep in a tensor constructor."""
    if not _is_real(v):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def _is_int_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_sequence(field: str, value: Any, want: str) -> None:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise RolloutDataError(f"field '{field}' is {_describe(value)}; {want}")


def _as_tensor_if_array(value: Any) -> Any:
    """numpy arrays (and other array-likes) are read like tensors."""
    if not isinstance(value, torch.Tensor) and hasattr(value, "__array__"):
        try:
            return torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            return value  # not numeric: the converter's type check names it
    return value


def _check_1d(field: str, value: torch.Tensor) -> None:
    if value.dim() != 1:
        raise RolloutDataError(
            f"field '{field}' is a tensor of shape {tuple(value.shape)}; give a 1-D tensor "
            "(one sample per RolloutSample, no batch dimension)"
        )


def _token_converter(field: str) -> Callable[[Any], torch.Tensor]:
    want = "give a list (or 1-D integer tensor) of int token ids"

    def convert(value: Any) -> torch.Tensor:
        value = _as_tensor_if_array(value)
        if isinstance(value, torch.Tensor):
            if not _is_int_dtype(value.dtype):
                raise RolloutDataError(f"field '{field}' is a {value.dtype} tensor; {want}")
            _check_1d(field, value)
            return value.detach().to(device="cpu", dtype=torch.long)
        _check_sequence(field, value, want)
        if not len(value):
            return torch.zeros(0, dtype=torch.long)
        if any(isinstance(v, bool) for v in value):
            # torch.tensor([True, 3]) is an int64 tensor [1, 3]: a bool would train as token 1
            raise _first_bad_element(field, value, _fits_int64, want)
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise _first_bad_element(field, value, _fits_int64, want) from None
        if not _is_int_dtype(tensor.dtype) or tensor.dim() != 1:
            raise _first_bad_element(field, value, _fits_int64, want)
        return tensor.to(torch.long)

    return convert


def _is_mask_entry(v: Any) -> bool:
    return isinstance(v, bool) or (_is_int(v) and v in (0, 1))


def _convert_loss_mask(value: Any) -> torch.Tensor | None:
    field, want = "loss_mask", "give one 0/1 (or true/false) entry per response token"
    if value is None:
        return None  # filled with ones in RolloutSample.__attrs_post_init__
    value = _as_tensor_if_array(value)
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise RolloutDataError(f"field '{field}' is a {value.dtype} tensor; {want}")
        _check_1d(field, value)
        tensor = value.detach().cpu()
    else:
        _check_sequence(field, value, want)
        if not all(_is_mask_entry(v) for v in value):
            raise _first_bad_element(field, value, _is_mask_entry, want)
        return torch.tensor([bool(v) for v in value], dtype=torch.bool)
    if tensor.dtype != torch.bool:
        bad = ((tensor != 0) & (tensor != 1)).nonzero()
        if len(bad):
            j = int(bad[0])
            raise RolloutDataError(f"field '{field}' element {j} is {tensor[j].item()}; {want}")
    return tensor.to(torch.bool)


def _float_converter(field: str) -> Callable[[Any], torch.Tensor | None]:
    want = "give a list (or 1-D float tensor) of numbers, one per response token"

    def convert(value: Any) -> torch.Tensor | None:
        if value is None:
            return None
        value = _as_tensor_if_array(value)
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bool or value.is_complex():
                raise RolloutDataError(f"field '{field}' is a {value.dtype} tensor; {want}")
            _check_1d(field, value)
            return value.detach().to(device="cpu", dtype=torch.float32)
        _check_sequence(field, value, want)
        if not all(_is_finite_float(v) for v in value):
            raise _first_bad_element(field, value, _is_finite_float, want)
        return torch.tensor([float(v) for v in value], dtype=torch.float32)

    return convert


def _scalar(field: str, value: Any, ok: Callable[[Any], bool], want: str) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if not ok(value):
        raise RolloutDataError(f"field '{field}' is {_describe(value)}; {want}")
    return value


def _convert_reward(value: Any) -> float:
    want = "give one finite number per sample (a float holds magnitudes up to about 1.8e308)"
    return float(_scalar("reward", value, _is_finite_float, want))


def _convert_group_id(value: Any) -> int:
    want = "give an int in [-2**63, 2**63) naming the prompt this response answers"
    return int(_scalar("group_id", value, _fits_int64, want))


def _convert_policy_version(value: Any) -> int | None:
    if value is None:
        return None
    want = (
        "give the optimizer-step count (an int >= 0) of the weights that generated it, or omit it"
    )
    return int(_scalar("policy_version", value, lambda v: _fits_int64(v) and v >= 0, want))


def _convert_metadata(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RolloutDataError(f"field 'metadata' is {_describe(value)}; give a dict (or omit it)")
    return dict(value)


def _tensor_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a, b)


_tensor_eq = attrs.cmp_using(eq=_tensor_equal)


# -- one sample ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True, unsafe_hash=False)
class RolloutSample:
    """One prompt, one sampled response, its reward and group, and optional per-token data.

    Construction normalises types (token ids to 1-D int64, masks to bool, float fields to
    float32, all on the CPU) and raises `RolloutDataError` naming the field for a value of the
    wrong type; `RolloutBatch.validate` checks everything that depends on the model or on other
    fields. A missing ``loss_mask`` means "train on every response token".
    """

    prompt_tokens: torch.Tensor = attrs.field(
        converter=_token_converter("prompt_tokens"), eq=_tensor_eq
    )
    response_tokens: torch.Tensor = attrs.field(
        converter=_token_converter("response_tokens"), eq=_tensor_eq
    )
    reward: float = attrs.field(converter=_convert_reward)
    group_id: int = attrs.field(converter=_convert_group_id)
    loss_mask: torch.Tensor = attrs.field(default=None, converter=_convert_loss_mask, eq=_tensor_eq)
    rollout_logprobs: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("rollout_logprobs"), eq=_tensor_eq
    )
    ref_logprobs: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("ref_logprobs"), eq=_tensor_eq
    )
    values: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("values"), eq=_tensor_eq
    )
    policy_version: int | None = attrs.field(default=None, converter=_convert_policy_version)
    metadata: dict[str, Any] = attrs.field(factory=dict, converter=_convert_metadata)

    def __attrs_post_init__(self) -> None:
        if self.loss_mask is None:
            ones = torch.ones(self.response_tokens.numel(), dtype=torch.bool)
            object.__setattr__(self, "loss_mask", ones)

    @property
    def prompt_length(self) -> int:
        return self.prompt_tokens.numel()

    @property
    def response_length(self) -> int:
        return self.response_tokens.numel()

    @property
    def length(self) -> int:
        return self.prompt_length + self.response_length

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RolloutSample:
        """Build from a dict of plain values (one JSONL line); errors name the field only, the
        caller adds the sample index or line number."""
        if not isinstance(record, Mapping):
            raise RolloutDataError(
                f"record is {_describe(record)}; give a dict with fields {', '.join(REQUIRED_FIELDS)}"
            )
        known = REQUIRED_FIELDS + OPTIONAL_FIELDS
        for key in record:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise RolloutDataError(
                    f"unknown field {key!r}; {hint}known fields are {', '.join(known)}"
                )
        for key in REQUIRED_FIELDS:
            if key not in record or record[key] is None:
                raise RolloutDataError(
                    f"missing required field '{key}' (every sample needs "
                    f"{', '.join(REQUIRED_FIELDS)})"
                )
        return cls(**{k: v for k, v in record.items() if v is not None})

    def to_record(self) -> dict[str, Any]:
        """Plain JSON-ready values; optional fields that are absent are left out."""
        record: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens.tolist(),
            "response_tokens": self.response_tokens.tolist(),
            "reward": self.reward,
            "group_id": self.group_id,
            "loss_mask": self.loss_mask.to(torch.int64).tolist(),
        }
        for name in PER_TOKEN_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                record[name] = value.tolist()
        if self.policy_version is not None:
            record["policy_version"] = self.policy_version
        if self.metadata:
            record["metadata"] = self.metadata
        return record


# -- tensor views --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PaddedResponses:
    """Responses of the whole batch as ``[B, L]`` tensors (``L`` = longest response), for
    advantage estimators that work per group or per sequence. Padding positions hold 0 and are
    False in both masks."""

    tokens: torch.Tensor  # [B, L] int64
    mask: torch.Tensor  # [B, L] bool: a real response token
    loss_mask: torch.Tensor  # [B, L] bool: a response token that is trained on
    lengths: torch.Tensor  # [B] int64 response lengths
    rollout_logprobs: torch.Tensor | None  # [B, L] float32
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None


@attrs.frozen(kw_only=True)
class PackedMicrobatch:
    """Samples of one microbatch concatenated into one padding-free sequence of ``T`` tokens.

    Every per-token tensor is aligned with ``tokens`` (position ``j`` describes ``tokens[j]``,
    predicted from the logits at ``j - 1``); prompt positions are False in the masks and 0 in
    the float fields. ``cu_seqlens`` is int32, as varlen / flash attention kernels want it.
    """

    sample_indices: tuple[int, ...]  # batch index of each packed sequence, in packing order
    tokens: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32, sequence boundaries
    seq_ids: torch.Tensor  # [T] int64, 0..n-1: which packed sequence a token belongs to
    response_mask: torch.Tensor  # [T] bool: a response token
    loss_mask: torch.Tensor  # [T] bool: a response token that is trained on
    prompt_lengths: torch.Tensor  # [n] int64
    response_lengths: torch.Tensor  # [n] int64
    response_index: torch.Tensor  # [R] int64: flat positions of all response tokens, in order
    rollout_logprobs: torch.Tensor | None  # [T] float32
    ref_logprobs: torch.Tensor | None
    values: torch.Tensor | None

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def max_seqlen(self) -> int:
        lengths = self.prompt_lengths + self.response_lengths
        return int(lengths.max()) if lengths.numel() else 0

    def place_responses(self, batch_values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter a batch-level ``[B, L]`` per-response-token tensor (e.g. advantages from
        `RolloutBatch.padded_responses`) into this microbatch's ``[T]`` layout."""
        longest = int(self.response_lengths.max()) if self.response_lengths.numel() else 0
        if batch_values.dim() != 2 or batch_values.shape[1] < longest:
            raise RolloutDataError(
                f"place_responses needs a [B, L] tensor with L >= the longest response "
                f"({longest}), got shape {tuple(batch_values.shape)}"
            )
        rows = batch_values[list(self.sample_indices)]
        valid = torch.arange(rows.shape[1]) < self.response_lengths[:, None]
        out = torch.full((self.num_tokens,), fill, dtype=batch_values.dtype)
        out[self.response_index] = rows[valid]
        return out

    def responses_from_logits(self, values_t: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `place_responses` for values in *logit-position* alignment (what a
        backend returns: position ``t`` describes token ``t + 1``): one tensor per packed sequence
        with its response tokens' values, in packing order (`sample_indices`)."""
        # response token at packed position j is predicted by the logits at j - 1
        picked = values_t[self.response_index - 1]
        return list(torch.split(picked, self.response_lengths.tolist()))


# -- the batch -----------------------------------------------------------------------------


def _samples_tuple(samples: Sequence[RolloutSample]) -> tuple[RolloutSample, ...]:
    samples = tuple(samples)
    for i, sample in enumerate(samples):
        if not isinstance(sample, RolloutSample):
            raise RolloutDataError(
                f"sample {i}: is {_describe(sample)}; give RolloutSample objects "
                "(or use RolloutBatch.from_records for dicts)"
            )
    return samples


@attrs.frozen(unsafe_hash=False)
class RolloutBatch:
    """All samples of one RL step. Call `validate` once before planning microbatches."""

    samples: tuple[RolloutSample, ...] = attrs.field(converter=_samples_tuple)
    # Where each sample came from (e.g. "rollouts.jsonl line 17"), so that validation errors
    # point at the line to fix; None for batches built in memory.
    origins: tuple[str, ...] | None = attrs.field(default=None, eq=False, kw_only=True)

    def _label(self, i: int) -> str:
        if self.origins is None:
            return f"sample {i}"
        return f"sample {i} ({self.origins[i]})"

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]]) -> RolloutBatch:
        """Build from plain dicts; an unknown, missing or mistyped field raises
        `RolloutDataError` naming the sample index and field."""
        samples = []
        for i, record in enumerate(records):
            try:
                samples.append(RolloutSample.from_record(record))
            except RolloutDataError as err:
                raise RolloutDataError(f"sample {i}: {err}") from None
        return cls(tuple(samples))

    def to_records(self) -> list[dict[str, Any]]:
        return [s.to_record() for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> RolloutSample:
        return self.samples[index]

    # -- validation ------------------------------------------------------------------------

    def validate(self, *, vocab_size: int, max_seq_len: int, samples_per_prompt: int) -> None:
        """Raise one `RolloutDataError` listing every problem, each naming sample and field."""
        for name, value in (
            ("vocab_size", vocab_size),
            ("max_seq_len", max_seq_len),
            ("samples_per_prompt", samples_per_prompt),
        ):
            if not _is_int(value) or value < 1:
                raise RolloutDataError(f"validate: {name} must be a positive int, got {value!r}")
        if not self.samples:
            raise RolloutDataError("RolloutBatch has no samples; the rollout produced nothing")
        if self.origins is not None and len(self.origins) != len(self.samples):
            raise RolloutDataError(
                f"RolloutBatch has {len(self.samples)} samples but {len(self.origins)} origins"
            )
        problems: list[str] = []
        # The per-sample loop names every problem; a batch-wide check first spares it when
        # there is nothing to find (it cost 7 ms of a 0.1 s tiny-example step).
        if _batch_may_have_problems(self.samples, vocab_size, max_seq_len):
            for i, sample in enumerate(self.samples):
                problems.extend(
                    f"{self._label(i)}: {p}"
                    for p in _sample_problems(sample, vocab_size, max_seq_len)
                )
        problems.extend(self._presence_problems())
        problems.extend(self._group_problems(samples_per_prompt))
        if not problems and not any(bool(s.loss_mask.any()) for s in self.samples):
            problems.append(
                f"field 'loss_mask' is zero for every response token of all {len(self)} samples; "
                "nothing would be trained (check how the loss mask is built)"
            )
        if problems:
            shown = problems[:_MAX_LISTED_PROBLEMS]
            more = len(problems) - len(shown)
            lines = "\n  ".join(shown) + (f"\n  ... and {more} more" if more else "")
            noun = "problem" if len(problems) == 1 else "problems"
            raise RolloutDataError(f"rollout batch has {len(problems)} {noun}:\n  {lines}")

    def _presence_problems(self) -> list[str]:
        problems = []
        for name in PER_TOKEN_FLOAT_FIELDS:
            have = [getattr(s, name) is not None for s in self.samples]
            if any(have) and not all(have):
                first_missing = have.index(False)
                problems.append(
                    f"{self._label(first_missing)}: field '{name}' is missing but {sum(have)} other "
                    f"samples have it; give it for every sample or for none"
                )
        return problems

    def _group_problems(self, samples_per_prompt: int) -> list[str]:
        members: dict[int, list[int]] = {}
        for i, sample in enumerate(self.samples):
            members.setdefault(sample.group_id, []).append(i)
        problems = []
        for group_id, indices in members.items():
            if len(indices) != samples_per_prompt:
                listed = ", ".join(map(str, indices[:10])) + (", ..." if len(indices) > 10 else "")
                problems.append(
                    f"{self._label(indices[0])}: field 'group_id' = {group_id} is shared by "
                    f"{len(indices)} samples ({listed}) but samples_per_prompt is "
                    f"{samples_per_prompt}; every prompt needs exactly samples_per_prompt "
                    "responses (drop incomplete groups or fix samples_per_prompt)"
                )
        return problems

    # -- views -----------------------------------------------------------------------------

    @property
    def prompt_lengths(self) -> torch.Tensor:
        return torch.tensor([s.prompt_length for s in self.samples], dtype=torch.long)

    @property
    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([s.response_length for s in self.samples], dtype=torch.long)

    @property
    def lengths(self) -> torch.Tensor:
        """Prompt + response tokens per sample: what a microbatch packs."""
        return torch.tensor([s.length for s in self.samples], dtype=torch.long)

    @property
    def valid_token_counts(self) -> torch.Tensor:
        """Loss-mask tokens per sample: what the loss normalises by."""
        return torch.tensor([int(s.loss_mask.sum()) for s in self.samples], dtype=torch.long)

    @property
    def rewards(self) -> torch.Tensor:
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32)

    @property
    def group_ids(self) -> torch.Tensor:
        return torch.tensor([s.group_id for s in self.samples], dtype=torch.long)

    def has(self, field: str) -> bool:
        """Whether every sample carries the optional per-token ``field`` (after `validate`,
        a field is on all samples or none)."""
        if field not in PER_TOKEN_FLOAT_FIELDS:
            raise RolloutDataError(f"has(): {field!r} is not one of {PER_TOKEN_FLOAT_FIELDS}")
        return bool(self.samples) and all(getattr(s, field) is not None for s in self.samples)

    def padded_responses(self) -> PaddedResponses:
        """Responses as ``[B, L]`` tensors with masks (see `PaddedResponses`)."""

        def pad(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=0)

        lengths = self.response_lengths
        width = int(lengths.max()) if len(lengths) else 0
        optional = {
            name: pad([getattr(s, name) for s in self.samples]) if self.has(name) else None
            for name in PER_TOKEN_FLOAT_FIELDS
        }
        return PaddedResponses(
            tokens=pad([s.response_tokens for s in self.samples]),
            mask=torch.arange(width) < lengths[:, None],
            loss_mask=pad([s.loss_mask for s in self.samples]),
            lengths=lengths,
            **optional,
        )

    def pack(self, indices: Sequence[int]) -> PackedMicrobatch:
        """Concatenate samples ``indices`` (prompt then response each) into one flat sequence.

        An empty ``indices`` gives a microbatch of zero tokens (see `unirl.core.data.plan` for when a
        rank gets one)."""
        indices = tuple(int(i) for i in indices)
        samples = [self.samples[i] for i in indices]
        prompt_lengths = torch.tensor([s.prompt_length for s in samples], dtype=torch.long)
        response_lengths = torch.tensor([s.response_length for s in samples], dtype=torch.long)
        lengths = prompt_lengths + response_lengths
        cu_seqlens = torch.zeros(len(samples) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths, 0)
        total = int(cu_seqlens[-1])
        starts = cu_seqlens[:-1].to(torch.long)
        seq_ids = torch.repeat_interleave(torch.arange(len(samples)), lengths)
        position_ids = torch.arange(total) - starts[seq_ids]
        response_mask = position_ids >= prompt_lengths[seq_ids]
        response_index = response_mask.nonzero().flatten()

        def per_token(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros(total, dtype=dtype)
            if parts:
                out[response_index] = torch.cat(parts).to(dtype)
            return out

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

        optional = {
            name: per_token([getattr(s, name) for s in samples], torch.float32)
            if samples and all(getattr(s, name) is not None for s in samples)
            else None
            for name in PER_TOKEN_FLOAT_FIELDS
        }
        return PackedMicrobatch(
            sample_indices=indices,
            tokens=cat([t for s in samples for t in (s.prompt_tokens, s.response_tokens)]),
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            seq_ids=seq_ids,
            response_mask=response_mask,
            loss_mask=per_token([s.loss_mask for s in samples], torch.bool),
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
            response_index=response_index,
            **optional,
        )


def _batch_may_have_problems(
    samples: Sequence[RolloutSample], vocab_size: int, max_seq_len: int
) -> bool:
    """Whether `_sample_problems` could find anything in ``samples``: the same checks on whole
    concatenated tensors (a few ops per batch instead of several per sample). Only a batch that
    fails here goes through the per-sample loop, which names each sample and field."""
    prompt_lengths = [s.prompt_tokens.numel() for s in samples]
    response_lengths = [s.response_tokens.numel() for s in samples]
    if min(prompt_lengths) == 0 or min(response_lengths) == 0:
        return True
    if max(p + r for p, r in zip(prompt_lengths, response_lengths)) > max_seq_len:
        return True
    if not all(math.isfinite(s.reward) for s in samples):
        return True
    for name in ("loss_mask", *PER_TOKEN_FLOAT_FIELDS):
        sizes = [None if getattr(s, name) is None else getattr(s, name).numel() for s in samples]
        if any(n is not None and n != r for n, r in zip(sizes, response_lengths)):
            return True
    tokens = torch.cat([t for s in samples for t in (s.prompt_tokens, s.response_tokens)])
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        return True
    for name in PER_TOKEN_FLOAT_FIELDS:
        present = [getattr(s, name) for s in samples if getattr(s, name) is not None]
        if not present:
            continue
        values = torch.cat(present)
        if not bool(torch.isfinite(values).all()):
            return True
        if name in LOGPROB_FIELDS and bool((values > LOGPROB_TOLERANCE).any()):
            return True
    return False


def _sample_problems(sample: RolloutSample, vocab_size: int, max_seq_len: int) -> list[str]:
    """Everything wrong with one sample that `RolloutSample` construction cannot see."""
    problems = []
    n_response = sample.response_length
    if sample.prompt_length == 0:
        problems.append(
            "field 'prompt_tokens' is empty; the first response token is predicted from the last "
            "prompt token, so give at least one prompt token (e.g. BOS)"
        )
    if n_response == 0:
        problems.append(
            "field 'response_tokens' is empty; every sample needs at least one response token "
            "(keep the EOS token, or drop samples that generated nothing)"
        )
    for name in ("loss_mask", *PER_TOKEN_FLOAT_FIELDS):
        value = getattr(sample, name)
        if value is not None and value.numel() != n_response:
            problems.append(
                f"field '{name}' has {value.numel()} values but 'response_tokens' has "
                f"{n_response}; give one {_PER_TOKEN_WHAT[name]} per response token"
            )
    for name in ("prompt_tokens", "response_tokens"):
        tokens = getattr(sample, name)
        bad = ((tokens < 0) | (tokens >= vocab_size)).nonzero()
        if len(bad):
            j = int(bad[0])
            problems.append(
                f"field '{name}' has token id {int(tokens[j])} at position {j}, outside the "
                f"vocabulary [0, {vocab_size}); check that the tokenizer matches the model"
            )
    if sample.length > max_seq_len:
        problems.append(
            f"prompt ({sample.prompt_length}) + response ({n_response}) = {sample.length} tokens "
            f"exceeds max_seq_len={max_seq_len}; truncate the rollout or raise max_seq_len"
        )
    if not math.isfinite(sample.reward):
        problems.append(
            f"field 'reward' is {sample.reward}; rewards must be finite (fix the reward function "
            "or drop the sample)"
        )
    for name in PER_TOKEN_FLOAT_FIELDS:
        value = getattr(sample, name)
        if value is None:
            continue
        nonfinite = (~torch.isfinite(value)).nonzero()
        if len(nonfinite):
            j = int(nonfinite[0])
            problems.append(
                f"field '{name}' has {value[j].item()} at position {j}; every entry must be finite"
            )
        elif name in LOGPROB_FIELDS:
            positive = (value > LOGPROB_TOLERANCE).nonzero()
            if len(positive):
                j = int(positive[0])
                problems.append(
                    f"field '{name}' has {value[j].item():.6g} at position {j}, above 0; a "
                    f"log-probability is <= 0 (tolerance {LOGPROB_TOLERANCE:g}), so pass "
                    "log-probs, not probabilities or logits"
                )
    return problems
