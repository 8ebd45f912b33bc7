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


def _double(x, out):
    out.put(2 * x)


def in_a_child_process(prompts, responses, metadata, **_):
    """len(response) * 2, computed in a process this reward starts (as a sandbox or a pool
    would): possible only in a worker that is not a daemon."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    rewards = []
    for r in responses:
        out = ctx.Queue()
        child = ctx.Process(target=_double, args=(len(r), out))
        child.start()
        rewards.append(float(out.get(timeout=30)))
        child.join()
    return rewards


def leaves_a_process_and_hangs(prompts, responses, metadata, *, pid_file, **_):
    """Starts a long sleeper, writes its pid to ``pid_file``, then hangs past any timeout."""
    import subprocess

    sleeper = subprocess.Popen(["sleep", "300"])
    with open(pid_file, "w") as handle:
        handle.write(str(sleeper.pid))
    time.sleep(300)
    return [0.0] * len(responses)


def sleeps(prompts, responses, metadata, *, seconds, **_):
    """len(response) per sample, after ``seconds`` per call (one sample per call in a worker)."""
    time.sleep(seconds)
    return [float(len(r)) for r in responses]
