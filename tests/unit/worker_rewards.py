"""Reward functions for the reward-worker tests (imported by name in spawned workers)."""

import os
import time


def counted_length(prompts, responses, metadata, *, prompt_tokens, response_tokens, log):
    """len(response) per sample; appends one line per call (its sample count and pid) to
    ``log``, so a test counts the calls made across processes."""
    with open(log, "a") as handle:
        handle.write(f"{len(responses)} {os.getpid()}\n")
    return [float(len(r)) for r in responses]


def sleeps_on_flagged(prompts, responses, metadata, **_):
    """1.0, after sleeping a minute for a prompt whose metadata carries "slow"."""
    for m in metadata:
        if m.get("slow"):
            time.sleep(60)
    return [1.0] * len(responses)


def dies_on_flagged(prompts, responses, metadata, **_):
    """2.0; the process exits hard (no exception, no reply) for metadata carrying "boom"."""
    for m in metadata:
        if m.get("boom"):
            os._exit(7)
    return [2.0] * len(responses)


def raises_on_flagged(prompts, responses, metadata, **_):
    for m in metadata:
        if m.get("boom"):
            raise ValueError("cannot score this one")
    return [3.0] * len(responses)


def counted_hook(batch, *, rl_step):
    """Sets every reward to this process's pid and appends one line per call to the file
    $UNIRL_TEST_HOOK_LOG: which process ran the hook, and how often."""
    import attrs

    from unirl.core.data.rollout import RolloutBatch

    with open(os.environ["UNIRL_TEST_HOOK_LOG"], "a") as handle:
        handle.write(f"{rl_step} {os.getpid()}\n")
    return RolloutBatch(tuple(attrs.evolve(s, reward=float(os.getpid())) for s in batch.samples))
