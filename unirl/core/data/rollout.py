"""The rollout data contract: what a rollout engine hands to training, checked before anything runs.

A `RolloutSample` is one prompt and one sampled response with its reward and group (the prompt it
answers; GRPO normalises rewards within a group). Optional per-response-token fields carry what
the engine or a reference model already computed: the sampling log-probs (`rollout_logprobs`,
for off-policy correction and for skipping the old-log-prob forward), reference log-probs
(`ref_logprobs`, for the KL penalty), critic values (`values`, for GAE) and where parts of the
reward were earned (`token_rewards`, e.g. a multi-turn episode's per-turn rewards on each turn's
last token, for the token-level estimators; `reward` stays the total). A mixture-of-experts
engine can add the experts it routed every token to (`routed_experts`, for routing replay; one row
per token the model read, `unirl.core.data.routed_experts`). `policy_version` is the
optimizer-step count of the policy weights that generated the response (None: unknown, e.g. a
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

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from unirl.core.data.packed import PackedMicrobatch, PaddedResponses
from unirl.core.data.routed_experts import MoeShape, pack_routed_experts, routed_experts_problems
from unirl.core.data.sample import RolloutSample
from unirl.core.data.sample_checks import _batch_may_have_problems, _sample_problems
from unirl.core.data.sample_fields import (
    _MAX_LISTED_PROBLEMS,
    ALL_OR_NONE_FIELDS,
    LOGPROB_FIELDS,
    LOGPROB_TOLERANCE,
    OPTIONAL_FIELDS,
    PACKED_FLOAT_FIELDS,
    PER_TOKEN_FLOAT_FIELDS,
    REQUIRED_FIELDS,
    _describe,
    _is_int,
)
from unirl.core.errors import RolloutDataError

__all__ = [
    "LOGPROB_FIELDS",
    "LOGPROB_TOLERANCE",
    "OPTIONAL_FIELDS",
    "PER_TOKEN_FLOAT_FIELDS",
    "REQUIRED_FIELDS",
    "PackedMicrobatch",
    "PaddedResponses",
    "RolloutBatch",
    "RolloutSample",
]

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

    def validate(
        self,
        *,
        vocab_size: int,
        max_seq_len: int,
        samples_per_prompt: int,
        moe: MoeShape | None = None,
    ) -> None:
        """Raise one `RolloutDataError` listing every problem, each naming sample and field.

        ``moe``: the model's routing shape when routing replay is on; every sample must then
        carry ``routed_experts`` of that shape (without it, given experts are checked against
        the sample's length only)."""
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
        problems.extend(self._routed_experts_problems(moe))
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

    def _routed_experts_problems(self, moe: MoeShape | None) -> list[str]:
        problems = []
        if moe is not None and all(s.routed_experts is None for s in self.samples):
            problems.append(
                f"{self._label(0)}: field 'routed_experts' is missing but routing replay replays "
                f"it ({moe.num_moe_layers} MoE layers x top-{moe.top_k}); give the experts the "
                "engine routed every token to, for every sample"
            )
        for i, s in enumerate(self.samples):
            if s.routed_experts is None:
                continue
            problems.extend(
                f"{self._label(i)}: {p}"
                for p in routed_experts_problems(
                    s.routed_experts, s.prompt_length, s.response_length, moe
                )
            )
        return problems

    def _presence_problems(self) -> list[str]:
        problems = []
        for name in ALL_OR_NONE_FIELDS:
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
        if field not in ALL_OR_NONE_FIELDS:
            raise RolloutDataError(f"has(): {field!r} is not one of {ALL_OR_NONE_FIELDS}")
        return bool(self.samples) and all(getattr(s, field) is not None for s in self.samples)

    def with_routed_experts(self, experts: Mapping[int, torch.Tensor]) -> RolloutBatch:
        """This batch with ``routed_experts`` set on every sample (R2: the experts the
        old-log-prob forward recorded, `unirl.core.data.routed_experts.recorded_per_sample`,
        collected from every data-parallel rank); every sample index must be given."""
        missing = [i for i in range(len(self.samples)) if i not in experts]
        if missing:
            raise RolloutDataError(
                f"with_routed_experts: no recorded experts for samples {missing[:10]}; collect "
                "the recording forward's experts from every data-parallel rank"
            )
        samples = tuple(
            attrs.evolve(s, routed_experts=experts[i]) for i, s in enumerate(self.samples)
        )
        return attrs.evolve(self, samples=samples)

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
            for name in PACKED_FLOAT_FIELDS
        }
        routed = (
            pack_routed_experts([s.routed_experts for s in samples], lengths, cu_seqlens)  # type: ignore[misc]
            if samples and all(s.routed_experts is not None for s in samples)
            else None
        )
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
            routed_experts=routed,
            **optional,
        )
