"""Multi-turn episodes, token in and token out: the policy writes a turn, the environment answers,
the policy writes again, until the environment says done, ``rollout.max_turns`` turns were
written, or the episode reaches ``rollout.max_episode_tokens``.

The sample is built by appending ids, never by decoding and re-encoding the conversation:

    response = turn_0 ids (sampled) + observation_0 ids + turn_1 ids (sampled) + ...
    loss_mask        1 ... 1          0 ... 0            1 ... 1
    rollout_logprobs the engine's     0 (masked: not the policy's tokens)

so the trainer scores exactly the tokens the engine sampled. Each next turn is generated from
``prompt + response so far`` as token ids. The sample's reward is the sum of the per-turn rewards
(each is also kept in ``metadata["episode"]["turn_rewards"]``, with the response index of the
turn's last token in ``turn_ends``). An episode cut by the token limit ends there: its response
is cut to the limit (mask and log-probs with it) and it is flagged ``truncated``. For the
token-level estimators the sample also carries ``token_rewards``: each turn's reward on the last
token of that turn, zeros elsewhere (their sum is the sample's reward; an episode whose
environment failed has none there: its failure reward is the outcome at the last token).

The engine is a ``generate(prompts, progress, keys)`` callable: the token prompts of the
episodes still going, and for each its ``(episode index, turn index)`` (an engine with a seed
per request derives it from them).

An environment that raises, returns something malformed, or takes longer than
``rollout.env_step_timeout_s`` for one call stops the run with a `RolloutDataError` naming the
episode and turn, or, with ``rollout.env_failure_reward`` set, ends that episode with that
reward (flagged ``env_failed``). A hung call is abandoned on its daemon thread: the job goes on.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.progress.bars import GenerationProgress
from unirl.rollouts.environments.base import Environment, Observation, Turn, as_observation
from unirl.rollouts.sampler import Generation

# generate(token prompts, progress, [(episode index, turn index)]) -> one Generation per prompt
Generate = Callable[[Sequence[Sequence[int]], Any, Sequence[tuple[int, int]]], list[Generation]]


@attrs.frozen(kw_only=True)
class EpisodeLimits:
    """``max_turns`` policy turns per episode; ``max_tokens`` response tokens (turns and
    observations together); ``step_timeout_s`` per environment call (None: no limit);
    ``failure_reward`` the reward of an episode whose environment failed (None: fail the run)."""

    max_turns: int
    max_tokens: int
    step_timeout_s: float | None = None
    failure_reward: float | None = None


@attrs.define
class Episode:
    """One episode being built; `sample_fields` gives what goes into its `RolloutSample`."""

    env: Environment
    prompt: list[int]
    where: str
    index: int  # its place in the rollout
    limit: int = 0
    response: list[int] = attrs.field(factory=list)
    mask: list[bool] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    turn_rewards: list[float] = attrs.field(factory=list)
    turn_ends: list[int] = attrs.field(factory=list)
    turns: int = 0
    tool_calls: int = 0
    truncated: bool = False
    failed: str | None = None
    failure_reward: float | None = None
    done: bool = False

    @property
    def reward(self) -> float:
        if self.failed is not None:
            assert self.failure_reward is not None
            return self.failure_reward
        return float(sum(self.turn_rewards))

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> bool:
        """Append ids (the policy's with their log-probs, or an observation's with None, which
        gets mask 0 and log-prob 0), cut at the episode's token limit; True when cut."""
        room = self.limit - len(self.response)
        kept = [int(t) for t in ids[:room]]
        policy = logprobs is not None
        self.response.extend(kept)
        self.mask.extend([policy] * len(kept))
        self.logprobs.extend(list(logprobs)[: len(kept)] if policy else [0.0] * len(kept))
        return len(ids) > room

    def metadata(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "truncated": self.truncated,
            "env_failed": self.failed is not None,
            "turn_rewards": list(self.turn_rewards),
            "turn_ends": list(self.turn_ends),
            **({"env_error": self.failed} if self.failed is not None else {}),
        }

    def token_rewards(self) -> list[float]:
        """Each stepped turn's reward at the turn's last token, 0 elsewhere; all zeros for a
        failed episode (its failure reward replaces the turns')."""
        out = [0.0] * len(self.response)
        if self.failed is None:
            for end, reward in zip(self.turn_ends, self.turn_rewards):
                out[end] += reward
        return out

    def sample_fields(self) -> dict[str, Any]:
        return {
            "prompt_tokens": list(self.prompt),
            "response_tokens": torch.tensor(self.response, dtype=torch.long),
            "loss_mask": torch.tensor(self.mask, dtype=torch.bool),
            "rollout_logprobs": torch.tensor(self.logprobs, dtype=torch.float32),
            "reward": self.reward,
            "token_rewards": torch.tensor(self.token_rewards(), dtype=torch.float32),
        }


class _EnvFailure(Exception):
    pass


def call_with_timeout(fn: Callable[..., Any], args: tuple, timeout_s: float | None) -> Any:
    """``fn(*args)``; raises `_EnvFailure` describing an exception it raised, or a call that did
    not return within ``timeout_s`` (left running on a daemon thread, which exit does not wait
    for)."""
    if timeout_s is None:
        try:
            return fn(*args)
        except Exception as exc:
            raise _EnvFailure(f"{type(exc).__name__}: {exc}") from exc
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # reported to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name="unirl-env-step")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _EnvFailure(
            f"no answer within rollout.env_step_timeout_s={timeout_s:g} s (the call hangs)"
        )
    if "error" in box:
        exc = box["error"]
        raise _EnvFailure(f"{type(exc).__name__}: {exc}") from exc
    return box["value"]


class _TokensOnly:
    """The generation bar as one turn's `generate` sees it: tokens count, samples (turns) do
    not; the runner counts an episode when it ends."""

    def __init__(self, progress: GenerationProgress) -> None:
        self.progress = progress

    def update(self, *, samples: int = 0, tokens: int = 0) -> None:
        self.progress.update(tokens=tokens)


class EpisodeRunner:
    """Runs a rollout's episodes together: one `generate` call per turn for every episode still
    going (so episodes of different lengths share a rollout), then one environment step each.

    ``encode`` tokenises an observation's text (the run's tokenizer, once per observation);
    ``decode`` gives a turn's text from its ids; ``max_seq_len`` bounds prompt + response."""

    def __init__(
        self,
        generate: Generate,
        *,
        encode: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        limits: EpisodeLimits,
        max_seq_len: int,
        vocab_size: int,
    ) -> None:
        self.generate, self.encode, self.decode = generate, encode, decode
        self.limits, self.max_seq_len, self.vocab_size = limits, max_seq_len, vocab_size

    def _observation_ids(self, obs: Observation | None, where: str) -> list[int]:
        if obs is None:
            return []
        if obs.token_ids is not None:
            ids = list(obs.token_ids)
        else:
            assert obs.text is not None
            try:
                ids = list(self.encode(obs.text))
            except Exception as exc:
                raise _EnvFailure(
                    f"its observation {obs.text!r} cannot be tokenised ({type(exc).__name__}: "
                    f"{exc})"
                ) from exc
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise _EnvFailure(
                f"its observation holds token id {bad[0]}, outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        return ids

    def _fail(self, ep: Episode, turn: int, reason: str) -> None:
        message = (
            f"{ep.where}, turn {turn}: the environment failed: {reason}. Fix the environment, "
            "raise rollout.env_step_timeout_s, or set rollout.env_failure_reward to give such "
            "episodes a reward instead of stopping the run"
        )
        if self.limits.failure_reward is None:
            raise RolloutDataError(message)
        ep.failed, ep.failure_reward = reason, self.limits.failure_reward
        # A sample needs a response: an episode whose reset failed still gets its first turn.
        ep.done = bool(ep.response)

    def start(
        self,
        env: Environment,
        prompt: Sequence[int],
        text: str,
        meta: Mapping[str, Any],
        where: str,
        *,
        index: int,
    ) -> Episode:
        """A new episode (the ``index``-th of its rollout): ``env.reset(text, meta)``, its
        first observation appended to the prompt (context, not trained)."""
        ep = Episode(env=env, prompt=list(prompt), where=where, index=index)
        try:
            first = call_with_timeout(env.reset, (text, dict(meta)), self.limits.step_timeout_s)
            ep.prompt.extend(self._observation_ids(as_observation(first, where), where))
        except (_EnvFailure, ConfigError) as err:
            self._fail(ep, 0, f"reset: {err}")
        ep.limit = min(self.limits.max_tokens, self.max_seq_len - len(ep.prompt))
        if ep.limit < 1:
            raise RolloutDataError(
                f"{where}: prompt plus the first observation is {len(ep.prompt)} tokens, leaving "
                f"no room under model.max_seq_len={self.max_seq_len}; raise it"
            )
        return ep

    def run(self, episodes: list[Episode], progress: GenerationProgress | None = None) -> None:
        """Play ``episodes`` to the end (in place)."""
        tokens = None if progress is None else _TokensOnly(progress)
        active = [ep for ep in episodes if not ep.done]
        if progress is not None:
            progress.update(samples=len(episodes) - len(active))
        while active:
            gens = self.generate(
                [ep.prompt + ep.response for ep in active],
                tokens,
                [(ep.index, ep.turns) for ep in active],
            )
            for ep, gen in zip(active, gens):
                self._after_turn(ep, gen)
            still = [ep for ep in active if not ep.done]
            if progress is not None:  # a sample is finished when its episode is
                progress.update(samples=len(active) - len(still))
            active = still

    def _after_turn(self, ep: Episode, gen: Generation) -> None:
        index = ep.turns
        ids = [int(t) for t in gen.response_tokens.tolist()]
        cut = ep.append(ids, gen.logprobs.tolist())
        ep.turns += 1
        ep.turn_ends.append(len(ep.response) - 1)
        if cut:  # the environment never sees a partial turn
            ep.truncated, ep.done = True, True
        if ep.done or ep.failed is not None:  # (a failed reset: no environment to step)
            ep.done = True
            return
        turn = Turn(token_ids=tuple(ids), text=self.decode(ids), index=index, finished=gen.finished)
        try:
            result = call_with_timeout(ep.env.step, (turn,), self.limits.step_timeout_s)
            if not (isinstance(result, tuple) and len(result) == 3):
                raise _EnvFailure(
                    f"step returned {type(result).__name__}, not (observation, reward, done)"
                )
            obs_value, reward, done = result
            reward = float(reward)
            if not math.isfinite(reward):
                raise _EnvFailure(f"step returned the reward {reward}; rewards must be finite")
            obs = None if done else as_observation(obs_value, f"{ep.where}, turn {index}")
            obs_ids = self._observation_ids(obs, ep.where)
        except (_EnvFailure, ConfigError, TypeError, ValueError) as err:
            self._fail(ep, index, str(err))
            return
        ep.turn_rewards.append(reward)
        if done:
            ep.done = True
            return
        if ep.turns >= self.limits.max_turns or len(ep.response) >= ep.limit:
            ep.truncated, ep.done = True, True
            return
        ep.tool_calls += 1
        ep.append(obs_ids, None)
        if len(ep.response) >= ep.limit:  # no room left for the policy's next turn
            ep.truncated, ep.done = True, True
