"""Reward functions that fail on purpose (imported by name in the reward worker processes)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def _calls(counter: str) -> int:
    """This call's number (1-based) across every process, counted in a file."""
    path = Path(counter)
    with open(path, "a") as handle:
        handle.write("x")
    return path.stat().st_size


def math_then(prompts, responses, metadata, *, counter, after, how, **_):
    """The math reward (0 / 1 by the last number) for the first ``after`` calls, then ``how``:
    ``crash`` (the process dies), ``hang`` (sleeps past any timeout), ``spawn`` (starts a sleeper
    and hangs)."""
    from unirl.rollouts.rewards.math import math_answer

    if _calls(counter) > after:
        if how == "crash":
            os._exit(9)
        if how == "spawn":
            subprocess.Popen(["sleep", "600"])
        time.sleep(600)
    return math_answer(prompts, responses, metadata)
