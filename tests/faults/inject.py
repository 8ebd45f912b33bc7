"""``python -m tests.faults.inject FAULT -- <unirl args>``: run the unirl CLI in this process with
one fault installed first (a patch of the library, made here so that the library itself carries no
fault hooks). FAULT is ``name`` or ``name:argument``; see `FAULTS`."""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Callable


def disk_full_at_checkpoint(n: str) -> None:
    """The ``n``-th checkpoint publish (1-based) finds the disk full while it writes its marker."""
    from unirl.core.run import checkpointing

    original = checkpointing.publish
    calls = {"n": 0}

    def publish(partial, path, meta, *, client_state):
        calls["n"] += 1
        if calls["n"] == int(n):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "complete"))
        return original(partial, path, meta, client_state=client_state)

    checkpointing.publish = publish


def kill_rank_in_worker(spec: str) -> None:
    """``rank,rollout``: global rank ``rank`` kills itself (SIGKILL) when its async worker starts
    generating rollout ``rollout``."""
    rank, rollout = (int(x) for x in spec.split(","))
    if int(os.environ.get("RANK", "0")) != rank:
        return
    from unirl.rollouts import async_source

    original = async_source.RolloutsAhead._generate

    def generate(self, rl_step, weights, version):
        if rl_step == rollout:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, rl_step, weights, version)

    async_source.RolloutsAhead._generate = generate


def hang_eval(step: str) -> None:
    """Global rank 0's evaluation after RL step ``step`` hangs (sleeps ten minutes): the other
    ranks wait for it at most ``eval.timeout_s``."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    import time

    from unirl.rollouts.eval.evaluator import Evaluator

    original = Evaluator._evaluate

    def evaluate(self, done):
        if done == int(step):
            time.sleep(600)
        return original(self, done)

    Evaluator._evaluate = evaluate


def adapter_delivery() -> tuple[tuple[type, str], ...]:
    """The methods that hand an adapter to its receiver (what `drop_adapter_sync` patches; a
    test in one process puts every one of them back afterwards)."""
    from unirl.rollouts.sampler_source import SamplerRolloutSource
    from unirl.rollouts.vllm.source import VllmRolloutSource
    from unirl.serve.vllm_engine import ServeEngine

    return (
        (SamplerRolloutSource, "_load_adapter"),
        (VllmRolloutSource, "_deliver_adapter"),
        (ServeEngine, "_deliver_adapter"),  # unirl serve's engine (serve.sampling: vllm)
    )


def drop_adapter_sync(n: str) -> None:
    """The ``n``-th adapter sync (1-based, counted per source) is never delivered: the sampler
    keeps its adapter, the vLLM engine is never given the new LoRA request (it goes on serving
    the previous one); everything else of the sync runs."""
    for cls, method in adapter_delivery():
        original = getattr(cls, method)
        calls = {"n": 0}

        def dropping(self, *args, _original=original, _calls=calls):
            _calls["n"] += 1
            if _calls["n"] != int(n):
                _original(self, *args)

        setattr(cls, method, dropping)


FAULTS: dict[str, Callable[[str], None]] = {
    "disk_full_at_checkpoint": disk_full_at_checkpoint,
    "drop_adapter_sync": drop_adapter_sync,
    "hang_eval": hang_eval,
    "kill_rank_in_worker": kill_rank_in_worker,
}


def main() -> int:
    fault, sep, *args = sys.argv[1:]
    assert sep == "--", "usage: python -m tests.faults.inject FAULT -- <unirl args>"
    name, _, argument = fault.partition(":")
    FAULTS[name](argument)
    from unirl.cli import main as unirl_main

    return unirl_main(args)


if __name__ == "__main__":
    sys.exit(main())
