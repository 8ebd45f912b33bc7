"""The microbatch plan: which samples go to which optimizer step, data-parallel rank and
microbatch, and the global normalisers of every step.

Every rank builds the same plan from the same global batch (the plan is a pure, deterministic
function of sequence lengths and config), so no collective is needed to agree on it or on the
counts each loss divides by.

1. Order. Samples keep batch order, or a seeded shuffle of it (of whole groups when
   ``group_ids`` is given, so a group stays contiguous).
2. Optimizer steps. The order is cut into ``num_optimizer_steps`` contiguous, equal slices.
3. Data-parallel ranks, balanced by length (prompt + response tokens):
   - count mode (``micro_batch_size``): longest-first in rounds of ``dp_size`` samples, the
     longest of a round to the least-loaded rank, so every rank gets the same number of
     samples. The rank loads then differ by at most the longest sample: in a round the heavier
     rank gets the shorter sample, so the spread never grows past one round's spread.
   - token mode (``max_tokens_per_microbatch``): longest-first to the least-loaded rank (LPT),
     with no equal-count constraint; the loads again differ by at most the longest sample.
4. Microbatches within a rank:
   - count mode: the same round-robin balancing into ``samples_per_rank / micro_batch_size``
     microbatches of exactly ``micro_batch_size`` samples.
   - token mode: first-fit-decreasing into bins of at most the budget gives each rank's
     microbatch count; the step uses the largest over ranks (Megatron's schedule and DeepSpeed's
     gradient accumulation both need the same count on every rank). Each rank then spreads its
     samples longest-first over that many microbatches if that keeps every one within the
     budget, else keeps its bins and splits the largest splittable bin in two until the count
     is reached. A rank with fewer samples than the step's microbatch count gets empty
     microbatches (empty tuples, listed last): the backend must still run them, as a
     microbatch with no valid tokens, so that collectives stay in step.

A microbatch is listed with its sample indices in ascending order; a rank's microbatches run
heaviest first, so an out-of-memory shows on the first one. ``dp_size`` is the data-parallel
size without context parallel: CP ranks of one DP rank share its samples.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import Any

import attrs

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import ConfigError

# The sample indices of one microbatch (the plan assigns samples; `RolloutBatch.pack` packs them).
SampleIndices = tuple[int, ...]


@attrs.frozen(kw_only=True)
class OptimizerStepPlan:
    """One optimizer step: microbatches per data-parallel rank and the step's global counts."""

    index: int
    counts: GlobalCounts
    # [dp_rank][microbatch] -> sample indices, and the tokens (prompt + response) of each.
    rank_microbatches: tuple[tuple[SampleIndices, ...], ...]
    rank_microbatch_tokens: tuple[tuple[int, ...], ...]

    @property
    def num_microbatches(self) -> int:
        """Microbatches of this step on every rank (the same number on each)."""
        return len(self.rank_microbatches[0])

    @property
    def sample_indices(self) -> tuple[int, ...]:
        return tuple(sorted(i for mbs in self.rank_microbatches for mb in mbs for i in mb))

    @property
    def rank_tokens(self) -> tuple[int, ...]:
        return tuple(sum(tokens) for tokens in self.rank_microbatch_tokens)

    def microbatches(self, dp_rank: int) -> list[SampleIndices]:
        if not 0 <= dp_rank < len(self.rank_microbatches):
            raise ConfigError(
                f"dp_rank={dp_rank} is outside [0, {len(self.rank_microbatches)}) for a plan "
                "built for that many data-parallel ranks; build the plan with the run's dp size"
            )
        return list(self.rank_microbatches[dp_rank])


@attrs.frozen(kw_only=True)
class MicrobatchPlan:
    """Optimizer steps x data-parallel ranks x microbatches of one batch (see module docstring)."""

    steps: tuple[OptimizerStepPlan, ...]
    dp_size: int
    micro_batch_size: int | None
    max_tokens_per_microbatch: int | None
    order: tuple[int, ...]  # the batch order the steps were cut from (after any shuffle)

    @property
    def num_microbatches(self) -> tuple[int, ...]:
        """Microbatches per rank of each optimizer step (token mode may differ per step)."""
        return tuple(step.num_microbatches for step in self.steps)

    @property
    def num_samples(self) -> int:
        return len(self.order)

    @classmethod
    def build(
        cls,
        sequence_lengths: Sequence[int],
        valid_token_counts: Sequence[int],
        *,
        num_optimizer_steps: int,
        dp_size: int,
        micro_batch_size: int | None = None,
        max_tokens_per_microbatch: int | None = None,
        norm_length: int | None = None,
        shuffle_seed: int | None = None,
        group_ids: Sequence[int] | None = None,
    ) -> MicrobatchPlan:
        """Plan a batch from its per-sample lengths (prompt + response tokens) and valid
        (loss-mask) token counts; set exactly one of ``micro_batch_size`` and
        ``max_tokens_per_microbatch``. ``group_ids`` only matters with ``shuffle_seed``."""
        lengths = [int(x) for x in sequence_lengths]
        valid = [int(x) for x in valid_token_counts]
        _check_arguments(
            lengths, valid, num_optimizer_steps, dp_size, micro_batch_size,
            max_tokens_per_microbatch, group_ids,
        )  # fmt: skip
        order = _order(len(lengths), shuffle_seed, group_ids)
        per_step = len(order) // num_optimizer_steps
        steps = []
        for k in range(num_optimizer_steps):
            members = order[k * per_step : (k + 1) * per_step]
            if micro_batch_size is not None:
                ranks = _round_robin_balance(members, lengths, dp_size)
                per_rank_mbs = len(ranks[0]) // micro_batch_size
                rank_mbs = [_round_robin_balance(r, lengths, per_rank_mbs) for r in ranks]
            else:
                assert max_tokens_per_microbatch is not None
                rank_mbs = _token_budget_microbatches(
                    members, lengths, dp_size, max_tokens_per_microbatch
                )
            rank_mbs = [_arrange(mbs, lengths) for mbs in rank_mbs]
            steps.append(
                OptimizerStepPlan(
                    index=k,
                    counts=GlobalCounts(
                        tokens=sum(valid[i] for i in members),
                        # a sequence whose loss mask is all zero adds nothing to a sequence mean
                        sequences=sum(1 for i in members if valid[i] > 0),
                        norm_length=norm_length,
                    ),
                    rank_microbatches=tuple(rank_mbs),
                    rank_microbatch_tokens=tuple(
                        tuple(sum(lengths[i] for i in mb) for mb in mbs) for mbs in rank_mbs
                    ),
                )
            )
        return cls(
            steps=tuple(steps),
            dp_size=dp_size,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            order=tuple(order),
        )

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for printing (`unirl check`, the start of a run)."""
        steps = []
        for step in self.steps:
            mb_tokens = [t for tokens in step.rank_microbatch_tokens for t in tokens]
            steps.append(
                {
                    "samples": len(step.sample_indices),
                    "valid_tokens": step.counts.tokens,
                    "valid_sequences": step.counts.sequences,
                    "microbatches_per_rank": step.num_microbatches,
                    "tokens_per_rank": list(step.rank_tokens),
                    "max_microbatch_tokens": max(mb_tokens),
                    "empty_microbatches": sum(
                        1 for mbs in step.rank_microbatches for mb in mbs if not mb
                    ),
                }
            )
        return {
            "mode": "micro_batch_size" if self.micro_batch_size is not None else "token_budget",
            "micro_batch_size": self.micro_batch_size,
            "max_tokens_per_microbatch": self.max_tokens_per_microbatch,
            "dp_size": self.dp_size,
            "samples": self.num_samples,
            "optimizer_steps": len(self.steps),
            "steps": steps,
        }


# -- checks ----------------------------------------------------------------------------------


def _check_arguments(
    lengths: list[int],
    valid: list[int],
    num_optimizer_steps: int,
    dp_size: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    group_ids: Sequence[int] | None,
) -> None:
    n = len(lengths)
    if len(valid) != n:
        raise ConfigError(
            f"MicrobatchPlan.build got {n} sequence_lengths but {len(valid)} valid_token_counts; "
            "give one of each per sample"
        )
    if group_ids is not None and len(group_ids) != n:
        raise ConfigError(f"MicrobatchPlan.build got {len(group_ids)} group_ids for {n} samples")
    for i, (length, count) in enumerate(zip(lengths, valid)):
        if length < 1 or not 0 <= count <= length:
            raise ConfigError(
                f"sample {i}: sequence length {length} and valid token count {count}; a sample "
                "has at least one token and 0 <= valid tokens <= its length"
            )
    if n == 0:
        raise ConfigError("MicrobatchPlan.build got an empty batch; the rollout produced nothing")
    for name, value in (("num_optimizer_steps", num_optimizer_steps), ("dp_size", dp_size)):
        if value < 1:
            raise ConfigError(f"MicrobatchPlan.build: {name} must be >= 1, got {value}")
    if (micro_batch_size is None) == (max_tokens is None):
        raise ConfigError(
            "set exactly one of batch.micro_batch_size (samples per microbatch) and "
            f"batch.max_tokens_per_microbatch (token budget); got micro_batch_size="
            f"{micro_batch_size}, max_tokens_per_microbatch={max_tokens}"
        )
    if n % num_optimizer_steps:
        raise ConfigError(
            f"the batch has {n} samples, which do not split into {num_optimizer_steps} equal "
            "optimizer steps; make the batch size a multiple of batch.samples_per_optimizer_step"
        )
    per_step = n // num_optimizer_steps
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ConfigError(f"batch.micro_batch_size must be >= 1, got {micro_batch_size}")
        split_per_rank(per_step, dp_size, micro_batch_size)
    else:
        assert max_tokens is not None
        if max_tokens < 1:
            raise ConfigError(f"batch.max_tokens_per_microbatch must be >= 1, got {max_tokens}")
        longest = max(range(n), key=lambda i: (lengths[i], -i))
        if lengths[longest] > max_tokens:
            raise ConfigError(
                f"sample {longest} has {lengths[longest]} tokens (prompt + response), more than "
                f"batch.max_tokens_per_microbatch={max_tokens}; raise max_tokens_per_microbatch "
                f"to at least {lengths[longest]} or cap the rollout length"
            )
        if per_step < dp_size:
            raise ConfigError(
                f"batch.samples_per_optimizer_step={per_step} is smaller than the data-parallel "
                f"size {dp_size}, so some rank would get no sample; use at least {dp_size}"
            )


def split_per_rank(
    samples_per_step: int, dp_size: int, micro_batch_size: int | None, *, key: str = "batch"
) -> tuple[int, int | None]:
    """The divisibility rules of an optimizer step, checked here only (the config checks them
    through this function at load, the plan again for the batch it is given): the step's samples
    split evenly over the data-parallel ranks and, with a fixed microbatch size, each rank's
    share into whole microbatches. Returns ``(samples per rank, microbatches per rank or None
    with a token budget)``."""
    if samples_per_step % dp_size:
        raise ConfigError(
            f"batch.samples_per_optimizer_step={samples_per_step} is not divisible by the "
            f"data-parallel size {dp_size}; make it a multiple of {dp_size}"
        )
    per_rank = samples_per_step // dp_size
    if micro_batch_size is None:
        return per_rank, None
    if per_rank % micro_batch_size:
        raise ConfigError(
            f"batch.samples_per_optimizer_step={samples_per_step} is not divisible by "
            f"{key}.micro_batch_size x data-parallel size = {micro_batch_size} x {dp_size}; "
            f"choose a multiple of {micro_batch_size * dp_size}"
        )
    return per_rank, per_rank // micro_batch_size


# -- the algorithms --------------------------------------------------------------------------


def _order(n: int, shuffle_seed: int | None, group_ids: Sequence[int] | None) -> list[int]:
    if shuffle_seed is None:
        return list(range(n))
    rng = random.Random(shuffle_seed)  # Python's generator: the same on every rank
    if group_ids is None:
        order = list(range(n))
        rng.shuffle(order)
        return order
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(int(g), []).append(i)
    blocks = list(groups.values())  # in order of first appearance
    rng.shuffle(blocks)
    return [i for block in blocks for i in block]


def _longest_first(items: Sequence[int], lengths: list[int]) -> list[int]:
    return sorted(items, key=lambda i: (-lengths[i], i))


def _round_robin_balance(items: Sequence[int], lengths: list[int], parts: int) -> list[list[int]]:
    """Split ``items`` into ``parts`` lists of equal size, balanced by length: longest first, in
    rounds of ``parts``; in each round the i-th longest goes to the i-th least-loaded part."""
    assert len(items) % parts == 0
    out: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    ranked = _longest_first(items, lengths)
    for start in range(0, len(ranked), parts):
        by_load = sorted(range(parts), key=lambda p: (loads[p], p))
        for p, i in zip(by_load, ranked[start : start + parts]):
            out[p].append(i)
            loads[p] += lengths[i]
    return out


def _lpt(
    items: Sequence[int], lengths: list[int], parts: int, budget: int | None = None
) -> list[list[int]] | None:
    """Longest-first to the least-loaded part; None if a part would exceed ``budget``."""
    out: list[list[int]] = [[] for _ in range(parts)]
    heap = [(0, p) for p in range(parts)]
    for i in _longest_first(items, lengths):
        load, p = heapq.heappop(heap)
        if budget is not None and load + lengths[i] > budget:
            return None
        out[p].append(i)
        heapq.heappush(heap, (load + lengths[i], p))
    return out


def _first_fit_decreasing(items: Sequence[int], lengths: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in _longest_first(items, lengths):
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _split_to(bins: list[list[int]], lengths: list[int], target: int) -> list[list[int]]:
    """Split the heaviest bin holding two or more samples in two until there are ``target``
    bins; pad with empty bins once every bin holds a single sample."""
    bins = [list(b) for b in bins]
    while len(bins) < target:
        splittable = [b for b in range(len(bins)) if len(bins[b]) >= 2]
        if not splittable:
            bins.extend([] for _ in range(target - len(bins)))
            break
        b = max(splittable, key=lambda b: (sum(lengths[i] for i in bins[b]), -b))
        halves = _lpt(bins.pop(b), lengths, 2)
        assert halves is not None
        bins.extend(halves)
    return bins


def _token_budget_microbatches(
    members: Sequence[int], lengths: list[int], dp_size: int, budget: int
) -> list[list[list[int]]]:
    ranks = _lpt(members, lengths, dp_size)
    assert ranks is not None
    packed = [_first_fit_decreasing(r, lengths, budget) for r in ranks]
    target = max(len(bins) for bins in packed)
    out = []
    for rank_items, bins in zip(ranks, packed):
        spread = _lpt(rank_items, lengths, target, budget)
        out.append(spread if spread is not None else _split_to(bins, lengths, target))
    return out


def _arrange(microbatches: list[list[int]], lengths: list[int]) -> tuple[SampleIndices, ...]:
    """Sorted indices inside a microbatch; heaviest microbatch first, empty ones last."""
    mbs = [tuple(sorted(mb)) for mb in microbatches]
    return tuple(
        sorted(mbs, key=lambda mb: (-sum(lengths[i] for i in mb), mb[0] if mb else len(lengths)))
    )
