"""The SDK's sample request as vLLM's `SamplingParams`, and vLLM's answer as the SDK's
`SampleResponse` (``serve.sampling: vllm``). Plain data both ways, so the mapping is tested
without an engine; importing this module imports neither torch nor vLLM.

    SDK (`SampleJob`)            vLLM SamplingParams
    num_samples                  n (vLLM seeds sample i with seed + i)
    max_tokens, temperature,     max_tokens, temperature (>= 0.01: vLLM raises a lower one to
                                 0.01, so it is refused), top_p, top_k (-1: none)
    top_p, top_k, seed           seed (>= 0: vLLM reads -1 as none, so negatives are refused)
    stop None                    stop_token_ids = the model's EOS ids (the engine has no
                                 tokenizer, so vLLM knows no EOS of its own)
    stop [ids]                   stop_token_ids = ids; [] never stops before max_tokens
    (sampled tokens' logprobs)   logprobs=0: the sampled token's own, from the distribution it
                                 was drawn from (the engine's logprobs_mode processed_logprobs)
    prompt_logprobs              prompt_logprobs=0: log p(token | before) at temperature 1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from unirl.serve.errors import BadRequest
from unirl.serve.sampling import SampleJob
from unirl.serve.wire import WireSequence

# vLLM samples any temperature in (0, this) at this one (vllm/sampling_params.py _MAX_TEMP),
# and reports that distribution's log-probs.
MIN_TEMPERATURE = 0.01


def check_sample(job: SampleJob) -> None:
    """Refuse (400, before the request is queued) what vLLM would answer otherwise than asked."""
    if job.temperature < MIN_TEMPERATURE:
        raise BadRequest(
            "sampling_params.temperature",
            f"is {job.temperature:g}; vLLM samples below {MIN_TEMPERATURE} at {MIN_TEMPERATURE} "
            f"(serve.sampling: vllm): use {MIN_TEMPERATURE} or more",
        )
    if job.seed < 0:  # vLLM reads -1 as no seed: sampled unseeded, unlike any other seed
        raise BadRequest(
            "sampling_params.seed",
            f"is {job.seed}; vLLM reads -1 as no seed (serve.sampling: vllm): use 0 or more, "
            "or send none (serve.sample_seed then decides)",
        )


def sampling_kwargs(job: SampleJob, eos_ids: Sequence[int]) -> dict[str, Any]:
    """The `vllm.SamplingParams` arguments of ``job`` (checked by `check_sample`); ``eos_ids``:
    the base model's EOS ids."""
    stop = list(eos_ids) if job.stop_tokens is None else list(job.stop_tokens)
    return {
        "n": job.num_samples,
        "max_tokens": job.max_tokens,
        "temperature": job.temperature,
        "top_p": job.top_p,
        "top_k": 0 if job.top_k == -1 else job.top_k,  # vLLM's 0: no top-k
        "seed": job.seed,
        "stop_token_ids": stop,
        "ignore_eos": True,  # the stops are exactly stop_token_ids
        "logprobs": 0,  # the sampled token's own log-prob only
        "prompt_logprobs": 0 if job.prompt_logprobs else None,
        "detokenize": False,  # token ids in and out
    }


def wire_sequences(completions: Sequence[Any]) -> list[WireSequence]:
    """vLLM's ``CompletionOutput`` list (one per sample) as the SDK's sequences: the sampled ids,
    each one's log-prob, and whether it stopped on a stop token (else on max_tokens)."""
    out = []
    for c in completions:
        tokens = [int(t) for t in c.token_ids]
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens, strict=True)]
        out.append(
            WireSequence(
                tokens=np.asarray(tokens, dtype=np.int64),
                logprobs=np.asarray(logprobs, dtype=np.float32),
                stopped=c.finish_reason == "stop",
            )
        )
    return out


def prompt_logprobs(prompt: Sequence[int], per_position: Sequence[Any]) -> np.ndarray:
    """vLLM's ``RequestOutput.prompt_logprobs`` (None, then ``{token id: Logprob}`` per prompt
    position) as ``[len(prompt)]`` floats: NaN for the first token (no context)."""
    values = [np.nan] + [float(d[t].logprob) for d, t in zip(per_position[1:], prompt[1:])]
    return np.asarray(values, dtype=np.float32)
