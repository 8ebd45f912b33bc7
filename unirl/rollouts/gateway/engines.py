"""The engine behind the gateway, and the queue that batches the agents' concurrent calls onto it.

Agents call one at a time each, but many at once: `GenerationQueue` runs one thread that takes
every call waiting, generates them in one engine call per token budget, and answers each call's
future. A call is a prompt (token ids), a seed and a budget; the answer a `Served`: the
`EngineSample` (ids, log-probs with the temperature applied, whether a stop ended it) and the
policy version of the weights that generated it, read from the engine under the lock its weight
sync takes, so a call is stamped with the version that served it, not the version of the moment
it arrived. With several engines each has a queue (`routing.EngineRouter`).

Two engines: the built-in sampler (`SamplerCalls`: the policy's copy in this process) and vLLM
(`VllmCalls`; a dead or hung engine is restarted and the batch re-issued, as for the vLLM
source's own rollouts). Both draw each call from a random stream of its own, seeded by the call's
seed, so a call's sample does not depend on the calls batched with it (up to the float rounding
of a batched forward).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

import attrs

from unirl.core.errors import RunError
from unirl.rollouts.sampler import Sampler
from unirl.rollouts.serving.engine import EngineRequest, EngineSample

logger = logging.getLogger(__name__)


class CallEngine(Protocol):
    """Generates one sample per prompt, each with its own seed, within ``max_new_tokens``."""

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]: ...


class SamplerCalls:
    """The built-in sampler as a `CallEngine`: each call drawn with a generator seeded by its
    seed; it samples its own budget and a call's smaller budget cuts the sample (the same
    tokens: generation is left to right)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]:
        out = []
        for gen in self.sampler.generate([list(p) for p in prompts], seeds=seeds):
            ids, lps = gen.response_tokens.tolist(), gen.logprobs.tolist()
            cut = len(ids) > max_new_tokens
            out.append(
                EngineSample(
                    response_tokens=tuple(int(t) for t in ids[:max_new_tokens]),
                    logprobs=tuple(float(x) for x in lps[:max_new_tokens]),
                    finished=gen.finished and not cut,
                )
            )
        return out


class VllmCalls:
    """A vLLM engine as a `CallEngine`; ``surviving(what, attempt)`` is the source's restart
    loop (`unirl.rollouts.vllm.source.VllmRolloutSource._surviving` on the engine this rank
    drives)."""

    def __init__(
        self,
        engine: Callable[[], object],
        surviving: Callable[[str, Callable[[], list[EngineSample]]], list[EngineSample]],
    ) -> None:
        self.engine, self.surviving = engine, surviving

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]:
        requests = [
            EngineRequest(prompt_tokens=tuple(int(t) for t in p), seed=s)
            for p, s in zip(prompts, seeds)
        ]
        return self.surviving(
            "an agent's calls",
            lambda: self.engine().generate(requests, max_new_tokens=max_new_tokens),  # type: ignore[attr-defined]
        )


class AwakeOnly:
    """An engine under vLLM's sleep mode (``rollout.agent.vllm.sleep``): awake only while a
    rollout's episodes run (the source wakes it before them and puts it to sleep after); a call
    that reaches it outside them (one an abandoned agent made before its episode timed out) is
    refused with a named error instead of meeting an engine without weights or KV cache."""

    def __init__(self, engine: CallEngine, awake: Callable[[], bool]) -> None:
        self.engine, self.awake = engine, awake

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]:
        if not self.awake():
            raise RunError(
                "the vLLM engine sleeps (rollout.agent.vllm.sleep) outside a rollout's episodes, "
                "and this call came when none was running (its episode had ended or timed out)"
            )
        return self.engine.generate(prompts, seeds, max_new_tokens)


@attrs.frozen
class Served:
    """A call's answer: the engine's sample and the policy version of the weights it used."""

    sample: EngineSample
    policy_version: int | None


@attrs.frozen
class _Call:
    prompt: tuple[int, ...]
    seed: int
    max_new_tokens: int
    future: Future


class GenerationQueue:
    """One thread feeding an engine: `submit` returns a future of the call's `Served`; the
    thread batches every call waiting when it comes round (up to ``max_batch``). ``version()``
    is the policy version the engine holds, read after each batch while ``lock`` (the one the
    engine's weight sync takes) is still held."""

    def __init__(
        self,
        engine: CallEngine,
        *,
        max_batch: int,
        version: Callable[[], int | None],
        lock: threading.Lock,
    ) -> None:
        self.engine, self.max_batch = engine, max_batch
        self.version, self.lock = version, lock
        self._queue: queue.Queue[_Call | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="unirl-gateway-engine", daemon=True)
        self._thread.start()
        self.batches = 0  # engine calls made (for the overhead benchmark)

    def submit(self, prompt: Sequence[int], *, seed: int, max_new_tokens: int) -> Future:
        future: Future = Future()
        self._queue.put(_Call(tuple(prompt), seed, max_new_tokens, future))
        return future

    def _take(self) -> list[_Call] | None:
        first = self._queue.get()
        if first is None:
            return None
        calls = [first]
        while len(calls) < self.max_batch:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # stop after this batch
                break
            calls.append(nxt)
        return calls

    def _loop(self) -> None:
        while (calls := self._take()) is not None:
            by_budget: dict[int, list[_Call]] = {}
            for c in calls:
                by_budget.setdefault(c.max_new_tokens, []).append(c)
            for budget, group in sorted(by_budget.items()):
                try:
                    with self.lock:
                        samples = self.engine.generate(
                            [c.prompt for c in group], [c.seed for c in group], budget
                        )
                        version = self.version()
                    if len(samples) != len(group):  # answered in full or not at all
                        raise RunError(
                            f"the engine answered {len(samples)} sample(s) to a batch of "
                            f"{len(group)} calls"
                        )
                    self.batches += 1
                except BaseException as exc:  # answered to every caller; the thread goes on
                    for c in group:
                        c.future.set_exception(exc)
                    continue
                for c, s in zip(group, samples, strict=True):
                    c.future.set_result(Served(s, version))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
