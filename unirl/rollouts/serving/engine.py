"""What a served rollout engine is to the code around it: a generator on token ids, one seeded
request per sample (`EngineRequest` in, `EngineSample` out, in request order). vLLM's
`unirl.rollouts.vllm.engine.VllmEngine` is one; a second engine (SGLang) implements the same
`TokenEngine` and reuses the episodes (`unirl.rollouts.serving.episodes`) and the sources' base
(`unirl.rollouts.generating`) unchanged.

A seed per request makes a sample independent of how the engine batches requests, so a resumed
run redraws what the uninterrupted run would have with no engine RNG state to checkpoint
(`sample_seed`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from unirl.rollouts.sampler import Generation


@attrs.frozen(kw_only=True)
class EngineRequest:
    """One sample to generate: its prompt ids and the seed of its own random stream (a seed per
    sample makes the output independent of how the engine batches requests)."""

    prompt_tokens: tuple[int, ...]
    seed: int


@attrs.frozen(kw_only=True)
class EngineSample:
    response_tokens: tuple[int, ...]  # ends with the stop token when ``finished``
    logprobs: tuple[float, ...]  # of each response token, as sampled (temperature applied)
    finished: bool  # ended by a stop token or stop string, not by max_new_tokens


class TokenEngine(Protocol):
    """A running engine that samples on token ids with the settings it was started with;
    ``temperature`` / ``max_new_tokens`` given: those instead, for these requests only (an
    evaluation's)."""

    def generate(
        self,
        requests: Sequence[EngineRequest],
        *,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[EngineSample]: ...


def sample_seed(seed: int, rollout: int, index: int) -> int:
    """A 31-bit seed for sample ``index`` of rollout ``rollout`` of a run seeded ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{rollout}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def as_generation(sample: EngineSample) -> Generation:
    """An engine's sample as the sampler's `Generation` (CPU tensors: int64 ids, float32
    log-probs), the form the sources' base and the episode runner take."""
    return Generation(
        response_tokens=torch.tensor(sample.response_tokens, dtype=torch.long),
        logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
        finished=sample.finished,
    )
