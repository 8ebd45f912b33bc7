"""Reward functions chosen by name (``rollout.reward``) for prompts read from a file.

``rollout.reward`` names a registered reward (``math_answer``, ``gsm8k``, ``exact_match``) or a user
function as ``"package.module:function"``; ``rollout.reward_options`` are extra keyword
arguments. A reward function is batched: it scores every sample of a rollout in one call::

    def reward(
        prompts: list[str],              # prompt text (decoded from the ids for a token prompt)
        responses: list[str],            # response text, special tokens (<eos>) removed
        metadata: list[dict],            # the prompt line's "metadata" (e.g. {"answer": "42"})
        *,
        prompt_tokens: list[list[int]],  # the ids the policy saw
        response_tokens: list[list[int]],# the ids it sampled (ending with eos when finished)
        **reward_options,
    ) -> Sequence[float]                 # one finite reward per sample, in order

All lists have one entry per sample; the ``samples_per_prompt`` samples of a prompt are
consecutive and share its metadata. Write ``**kwargs`` to ignore the token ids. It runs once
per rollout, on global rank 0, and the rewards are broadcast to the other ranks
(`unirl.rollouts.once`): a remote judge is called once per sample, not once per rank. By default
it runs in the training process; ``rollout.reward_workers: N`` runs it in N worker processes, one
sample per call, each within ``rollout.reward_timeout_s`` seconds (`unirl.rollouts.rewards.workers`);
a sample that times out, whose worker dies or whose call raises there gets
``rollout.reward_on_error`` (a number), or, with ``raise`` (the default), stops the run with
`RewardTimeoutError` / `RewardCrashError` / `RolloutDataError` naming the sample. `unirl check`
imports it and binds its signature; during a run a function that raises, returns the wrong
number of values or a non-finite one stops the run with a `RolloutDataError` naming the sample
(its prompt file line and response).

    register_reward("my_reward", my_reward)    # then rollout.reward: my_reward
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.imports import import_callable
from unirl.core.registry import Registry, same_callable
from unirl.rollouts.rewards.workers import (
    STARTUP_TIMEOUT_S,
    RewardCrashError,
    RewardError,
    RewardTimeoutError,
    RewardWorkers,
    SampleFailure,
)

logger = logging.getLogger(__name__)

KEY = "rollout.reward"
# What the other ranks allow beyond the bound of rank 0's scoring: they reach the wait at
# slightly different times, and the rewards travel pickled.
WAIT_SLACK_S = 30.0
RewardFn = Callable[..., Sequence[float]]
SIGNATURE = (
    "def reward(prompts, responses, metadata, *, prompt_tokens, response_tokens, **options) "
    "-> list[float]"
)


def _load_builtins() -> None:
    from unirl.rollouts.rewards import math as math_reward

    register_reward("math_answer", math_reward.math_answer)
    register_reward("exact_match", math_reward.exact_match)
    register_reward("gsm8k", math_reward.gsm8k)


REWARDS: Registry[RewardFn] = Registry(
    "reward function", key=KEY, same=same_callable, load=_load_builtins
)


def register_reward(name: str, fn: RewardFn) -> None:
    """Make ``rollout.reward: name`` call ``fn`` (the signature in the module docstring)."""
    REWARDS.register(name, fn)


def registered_rewards() -> list[str]:
    return REWARDS.names()


@attrs.frozen(kw_only=True)
class RewardRun:
    """Where the reward runs (``rollout.reward_workers``, ``reward_timeout_s``,
    ``reward_on_error``): ``workers`` processes (0: in the training process, which knows no
    time limit), each sample within ``timeout_s`` seconds, and a failed sample's reward
    (``"raise"``: stop the run with an error naming it)."""

    workers: int
    timeout_s: float | None
    on_error: float | str

    @classmethod
    def of(cls, cfg: Any) -> RewardRun:
        """From the run config's ``rollout`` section (``cfg``: a `UnirlConfig`)."""
        return cls(
            workers=cfg.rollout.reward_workers,
            timeout_s=cfg.rollout.reward_timeout_s,
            on_error=cfg.rollout.reward_on_error,
        )

    def wait_bound(self, samples: int) -> tuple[float, str] | None:
        """How long the other ranks wait for rank 0 to score ``samples`` samples (seconds, and
        how an error names it), derived from what bounds the scoring on rank 0: each worker
        scores at most ``ceil(samples / workers)`` of them, each within ``timeout_s``, and is
        (re)started before each within the workers' start bound. None: no bound (in the
        training process, or no ``timeout_s``), the others wait as long as rank 0 scores."""
        if self.workers == 0 or self.timeout_s is None:
            return None
        rounds = -(-samples // self.workers)
        seconds = STARTUP_TIMEOUT_S + rounds * (self.timeout_s + STARTUP_TIMEOUT_S) + WAIT_SLACK_S
        limit = (
            f"{seconds:g} s (rollout.reward_timeout_s={self.timeout_s:g} for each of "
            f"{rounds} samples per worker on rollout.reward_workers={self.workers}, "
            f"{STARTUP_TIMEOUT_S:g} s per worker start, {WAIT_SLACK_S:g} s slack)"
        )
        return seconds, limit


class NamedReward:
    """The reward function ``spec`` names, bound to its options, with every call checked; run
    in worker processes when ``run.workers`` > 0."""

    def __init__(
        self, spec: str, options: Mapping[str, Any] | None = None, run: RewardRun | None = None
    ) -> None:
        if ":" in spec:
            fn = import_callable(spec, key=KEY, what="a reward function")
        else:
            fn = REWARDS.get(spec, hint="or a reward function as 'package.module:function'")
        self.spec, self.fn, self.options = spec, fn, dict(options or {})
        try:
            inspect.signature(fn).bind(
                [], [], [], prompt_tokens=[], response_tokens=[], **self.options
            )
        except TypeError as exc:
            raise ConfigError(
                f"{KEY}={spec!r} with rollout.reward_options={self.options!r} cannot be called as "
                f"{SIGNATURE} ({exc}); fix the function's signature or the options"
            ) from None
        except ValueError:
            pass  # no signature to inspect (a builtin): the call itself will tell
        self.run = run
        self._workers: RewardWorkers | None = None
        if run is not None and run.workers > 0:
            self._workers = RewardWorkers(
                fn, self.options, count=run.workers, timeout_s=run.timeout_s, spec=spec
            )

    def close(self) -> None:
        """Stop the worker processes (none when the reward runs in this process)."""
        if self._workers is not None:
            self._workers.close()

    def __call__(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        *,
        prompt_tokens: Sequence[Sequence[int]],
        response_tokens: Sequence[Sequence[int]],
        origins: Sequence[str],
    ) -> list[float]:
        """The rewards, checked; ``origins`` name each sample's prompt (its file line) in
        errors."""
        n = len(prompts)
        inputs = (prompts, responses, metadata, prompt_tokens, response_tokens)
        if self._workers is not None:
            values = self._in_workers(inputs, origins)
        else:
            try:
                values = list(self._call(*inputs))
            except Exception as exc:  # user code: find the sample it fails on, name it
                raise self._failure(exc, inputs, origins) from exc
        if len(values) != n:
            raise RolloutDataError(
                f"{KEY}={self.spec!r} returned {len(values)} rewards for {n} samples; return "
                "one reward per response, in order"
            )
        rewards = []
        for i, value in enumerate(values):
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not ok or not math.isfinite(value):
                raise RolloutDataError(
                    f"{KEY}={self.spec!r} gave sample {i} ({origins[i]}, response "
                    f"{_short(responses[i])}) the reward {value!r}; return a finite number"
                )
            rewards.append(float(value))
        return rewards

    def _in_workers(self, inputs: tuple, origins: Sequence[str]) -> list[Any]:
        """One call per sample in the workers; failures become ``reward_on_error`` or raise."""
        assert self._workers is not None and self.run is not None
        stop = self.run.on_error == "raise"
        outcomes = self._workers.score(list(zip(*inputs)), stop_on_failure=stop)
        values: list[Any] = []
        failed: Counter[str] = Counter()
        for i, outcome in enumerate(outcomes):
            if outcome is None:  # not scored: a later sample failed and stops the run
                continue
            if isinstance(outcome, SampleFailure):
                if self.run.on_error == "raise":
                    raise self._worker_failure(outcome, i, inputs[1][i], origins[i])
                failed[outcome.kind] += 1
                values.append(float(self.run.on_error))
            elif len(outcome) != 1:
                raise RolloutDataError(
                    f"{KEY}={self.spec!r} returned {len(outcome)} rewards for sample {i} "
                    f"({origins[i]}), called alone in a reward worker; return one reward per "
                    "response, in order"
                )
            else:
                values.append(outcome[0])
        if outcomes and sum(failed.values()) == len(outcomes):
            # a constant for every sample teaches nothing: the reward is broken, not a sample
            first = next(o for o in outcomes if isinstance(o, SampleFailure))
            raise RewardError(
                f"{KEY}={self.spec!r}: every one of the {len(outcomes)} samples of this "
                f"rollout failed in the reward workers ({', '.join(f'{k} {c}' for k, c in sorted(failed.items()))}"
                f"; the first: {first.message}); rollout.reward_on_error={self.run.on_error} "
                "covers single failures, not a reward that fails on everything: fix the function"
            )
        if failed:
            logger.warning(
                "%s=%r: %d of %d samples failed in the reward workers (%s) and were scored "
                "rollout.reward_on_error=%s",
                KEY, self.spec, sum(failed.values()), len(outcomes),
                ", ".join(f"{kind} {count}" for kind, count in sorted(failed.items())),
                self.run.on_error,
            )  # fmt: skip
        return values

    def _worker_failure(
        self, failure: SampleFailure, i: int, response: str, origin: str
    ) -> Exception:
        where = f"sample {i} ({origin}, response {_short(response)})"
        fix = "; or set rollout.reward_on_error to the reward such a sample gets"
        if failure.kind == "timeout":
            return RewardTimeoutError(
                f"{KEY}={self.spec!r} timed out on {where}: {failure.message}; make the "
                f"function faster or raise rollout.reward_timeout_s{fix}"
            )
        if failure.kind == "crash":
            return RewardCrashError(
                f"{KEY}={self.spec!r} crashed its worker process on {where}: {failure.message}"
                f"; fix the function (or what it runs){fix}"
            )
        return RolloutDataError(
            f"{KEY}={self.spec!r} failed on {where}: {failure.message}; fix the function or "
            f"that prompt's metadata{fix}"
        )

    def _call(self, prompts, responses, metadata, prompt_tokens, response_tokens):
        return self.fn(
            list(prompts),
            list(responses),
            [dict(m) for m in metadata],
            prompt_tokens=[list(t) for t in prompt_tokens],
            response_tokens=[list(t) for t in response_tokens],
            **self.options,
        )

    def _failure(self, exc: Exception, inputs: tuple, origins: Sequence[str]) -> RolloutDataError:
        """The first sample that fails alone (the batch call cannot say which one did)."""
        for i in range(len(inputs[0])):
            try:
                self._call(*(column[i : i + 1] for column in inputs))
            except Exception as single:
                return RolloutDataError(
                    f"{KEY}={self.spec!r} failed on sample {i} ({origins[i]}, response "
                    f"{_short(inputs[1][i])}): {type(single).__name__}: {single}; fix the "
                    "function or that prompt's metadata"
                )
        return RolloutDataError(
            f"{KEY}={self.spec!r} raised {type(exc).__name__}: {exc} on a rollout of "
            f"{len(inputs[0])} samples (each sample alone scores fine); fix the function"
        )


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
