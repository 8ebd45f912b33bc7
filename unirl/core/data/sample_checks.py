"""Per-sample checks of a rollout batch that `RolloutSample` construction cannot see (token ids in
the vocabulary, lengths, finite values, log-probs <= 0), used by `RolloutBatch.validate`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from unirl.core.data.sample import RolloutSample
from unirl.core.data.sample_fields import (
    _PER_TOKEN_WHAT,
    LOGPROB_FIELDS,
    LOGPROB_TOLERANCE,
    PER_TOKEN_FLOAT_FIELDS,
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
    return any(_untrained_token_reward(s) is not None for s in samples)


def _untrained_token_reward(sample: RolloutSample) -> int | None:
    """The first response position with a nonzero token reward and loss mask 0 (None: none).
    The estimators see only trained tokens: a reward there would be lost without a word."""
    rewards = sample.token_rewards
    if rewards is None or rewards.numel() != sample.loss_mask.numel():
        return None
    bad = ((rewards != 0) & ~sample.loss_mask).nonzero()
    return int(bad[0]) if len(bad) else None


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
    j = _untrained_token_reward(sample)
    if j is not None:
        problems.append(
            f"field 'token_rewards' has {sample.token_rewards[j].item():g} at position {j}, "  # type: ignore[index]
            "where 'loss_mask' is 0 (a token not trained on, e.g. a tool's output); put each "
            "reward on a trained token (a turn's reward on the turn's last token)"
        )
    return problems
