"""What the gateway keeps of an episode: every call as the engine saw it, token in, token out.

A `CallRecord` holds the exact prompt ids the engine was given (the gateway's rendering of the
agent's request), the ids it sampled, their log-probs (temperature applied), which engine served
it and the policy version of the weights that sampled them, as that engine reported it (neither
engine behind the gateway returns routed experts on the CPU: `rollout.agent`'s rule refuses
``routing_replay: rollout``). An `EpisodeRecord` is one episode's calls in the order the gateway
received them, the engine they all go to, its request limits, and whether it is still open: a
call after its episode ended is refused (the key stays known, so the refusal says which episode
it was)."""

from __future__ import annotations

import threading

import attrs

from unirl.rollouts.serving.engine import sample_seed


@attrs.frozen(kw_only=True)
class CallRecord:
    """One call: ``index`` its place in the episode (arrival order); ``endpoint`` the API it came
    through; ``finished``: a stop ended it (not the token budget)."""

    index: int
    endpoint: str
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool
    policy_version: int | None
    engine: int = 0


class EpisodeFailure(Exception):
    """An episode ended as a failure; ``outcome`` names how (``crashed``, ``timeout``,
    ``too_many_calls_in_flight``, ``too_many_calls``, ``no_calls``, ``bad_reward``)."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


class EpisodeRecord:
    """One episode's calls and state. The app thread records calls; the runner closes it."""

    def __init__(
        self,
        key: str,
        where: str,
        *,
        seed: int,
        max_calls: int,
        max_in_flight: int,
        engine: int = 0,
    ) -> None:
        """``seed``: the episode's, from which each call's seed derives (`call_seed`);
        ``engine``: the one that serves every call of the episode (`routing.EngineRouter`)."""
        self.key, self.where, self.seed, self.engine = key, where, seed, engine
        self.max_calls, self.max_in_flight = max_calls, max_in_flight
        self.calls: list[CallRecord] = []
        self.open = True
        self.failure: EpisodeFailure | None = None  # a request limit the agent broke
        self._in_flight = 0
        self._started = 0
        self._lock = threading.Lock()

    def begin_call(self) -> int:
        """Reserve the next call's index; raises `EpisodeFailure` (and fails the episode) when a
        request limit is broken."""
        with self._lock:
            if self._in_flight >= self.max_in_flight:
                self._fail(
                    "too_many_calls_in_flight",
                    f"{self.where}: the agent had {self._in_flight} calls in flight and made "
                    f"another; rollout.agent.max_calls_in_flight={self.max_in_flight}",
                )
            if self._started >= self.max_calls:
                self._fail(
                    "too_many_calls",
                    f"{self.where}: the agent made more than rollout.agent.max_calls="
                    f"{self.max_calls} calls",
                )
            self._in_flight += 1
            self._started += 1
            return self._started - 1

    def call_seed(self, index: int) -> int:
        """The seed of call ``index``: fixed by the run's seed, the episode and the call's place,
        not by how the engine batches calls."""
        return sample_seed(self.seed, index, 0)

    def _fail(self, outcome: str, message: str) -> None:
        failure = EpisodeFailure(outcome, message)
        if self.failure is None:
            self.failure = failure
        raise failure

    def end_call(self, record: CallRecord | None) -> None:
        """The call reserved by `begin_call` is over (``record`` None: it failed)."""
        with self._lock:
            self._in_flight -= 1
            if record is not None and self.open:
                self.calls.append(record)

    def close(self) -> list[CallRecord]:
        """End the episode: later calls are refused; the calls in index order."""
        with self._lock:
            self.open = False
            return sorted(self.calls, key=lambda c: c.index)
