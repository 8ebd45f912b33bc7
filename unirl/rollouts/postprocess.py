"""The rollout post-processing hook (``algorithm.rollout_postprocess_hook``): user code that sees
every rollout before it is trained on, e.g. to reshape rewards or drop whole groups.

The config names it ``"package.module:function"``; like any plug-in it runs arbitrary user code
in the training process. Its signature is::

    def hook(batch: RolloutBatch, *, rl_step: int) -> RolloutBatch

It runs once, on global rank 0, and the batch it returns is broadcast to the other ranks
(`unirl.rollouts.once`), which wait for it at most ``algorithm.rollout_postprocess_timeout_s``
(then stop the run naming the hook; rank 0 does not interrupt it). What it returns is
validated like any rollout (a hook that breaks the contract stops the step with
`RolloutDataError` before anything is trained). `unirl check` imports it and checks the
signature, so a typo fails before a job is queued.

It declares no need to the old-log-prob decision (`unirl.core.old_logprobs`): it runs before any
policy log-prob of the rollout exists, so it cannot read them, and whatever batch it returns (fewer
samples, other rewards, even other tokens or rollout log-probs) gets the same old log-probs from
``reuse`` as from ``recompute`` (the policy's, on the same weights). The one thing it can change
that matters, the number of samples and so of optimizer steps, the decision already sees: it is
made for the batch the hook returned.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from unirl.core.config.run_config import UnirlConfig
from unirl.core.data.rollout import RolloutBatch
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.imports import import_callable
from unirl.rollouts.once import on_rank0

KEY = "algorithm.rollout_postprocess_hook"
Hook = Callable[..., RolloutBatch]


def load_postprocess_hook(cfg: UnirlConfig) -> Hook | None:
    """The configured hook, imported and its signature checked; None when none is set."""
    spec = cfg.algorithm.rollout_postprocess_hook
    if spec is None:
        return None
    fn = import_callable(spec, key=KEY, what="a rollout post-processing hook")
    try:
        inspect.signature(fn).bind(RolloutBatch(()), rl_step=0)
    except TypeError as exc:
        raise ConfigError(
            f"{KEY}={spec!r} cannot be called as hook(batch, *, rl_step) ({exc}); define it as "
            "'def hook(batch: RolloutBatch, *, rl_step: int) -> RolloutBatch'"
        ) from None
    except ValueError:
        pass  # no signature to inspect (a builtin): the call itself will tell
    return fn


def apply_postprocess_hook(
    hook: Hook, batch: RolloutBatch, rl_step: int, spec: str, *, timeout_s: float | None
) -> RolloutBatch:
    """The hook's batch, run on global rank 0 and broadcast (every rank holds ``batch``); the
    other ranks wait at most ``timeout_s`` (``algorithm.rollout_postprocess_timeout_s``)."""

    def run() -> RolloutBatch:
        out = hook(batch, rl_step=rl_step)
        if not isinstance(out, RolloutBatch):
            raise RolloutDataError(
                f"{KEY}={spec!r} returned {type(out).__name__} at rl_step {rl_step}; return a "
                "RolloutBatch (the batch it was given, changed or not)"
            )
        return out

    return on_rank0(
        run,
        f"{KEY}={spec!r} on the rollout of RL step {rl_step + 1} (rank 0 runs it)",
        timeout_s=timeout_s,
        key="algorithm.rollout_postprocess_timeout_s",
        advice="raise it if the hook needs longer, or make the hook faster (rank 0's stack, "
        "e.g. py-spy dump, shows where it waits)",
    )
