"""Reward functions for the reward-worker tests (imported by name in spawned workers)."""

import os
import time


def counted_length(prompts, responses, metadata, *, prompt_tokens, response_tokens, log):
    """len(response) per sample; appends one line per call (its sample count and pid) to
    ``log``, so a test counts the calls made across processes."""
    with open(log, "a") as handle:
        handle.write(f"{len(responses)} {os.getpid()}\n")
    return [float(len(r)) for r in responses]


def counted_hook(batch, *, rl_step):
    """Sets every reward to this process's pid and appends one line per call to the file
    $UNIRL_TEST_HOOK_LOG: which process ran the hook, and how often."""
    import attrs

    from unirl.core.data.rollout import RolloutBatch

    with open(os.environ["UNIRL_TEST_HOOK_LOG"], "a") as handle:
        handle.write(f"{rl_step} {os.getpid()}\n")
    return RolloutBatch(tuple(attrs.evolve(s, reward=float(os.getpid())) for s in batch.samples))


def misbehaves(prompts, responses, metadata, **_):
    """4.0, unless the metadata says: "slow" sleeps a minute, "exit" ends the process hard (no
    exception, no reply), "raise" raises."""
    for m in metadata:
        if m.get("slow"):
            time.sleep(60)
        if m.get("exit"):
            os._exit(7)
        if m.get("raise"):
            raise ValueError("cannot score this one")
    return [4.0] * len(responses)
