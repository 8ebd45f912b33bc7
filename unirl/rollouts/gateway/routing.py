"""Several engines behind the gateway: which engine serves an episode's calls.

An episode's calls all go to one engine (sticky): each call's prompt is the episode so far, so
the engine that served the last call holds its keys and values in its prefix cache, and the
episode's samples come from one engine's weights. A new episode goes to the engine with the
fewest open episodes (ties: the one that was given the fewest episodes so far, then the lowest
index), so a rollout's episodes spread evenly and a slow engine's long episodes do not pile more
onto it. Each engine has a `GenerationQueue` of its own (one thread batching its calls).

    router = EngineRouter([queue0, queue1])
    engine = router.assign()                         # when an episode opens
    served = router.submit(engine, prompt, seed=s, max_new_tokens=n).result()
    router.release(engine)                           # when it ends
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future

from unirl.rollouts.gateway.engines import GenerationQueue


class EngineRouter:
    """The engines' queues and how many episodes each serves now (see the module docstring)."""

    def __init__(self, queues: Sequence[GenerationQueue]) -> None:
        self.queues = list(queues)
        self.open = [0] * len(self.queues)  # episodes open on each engine
        self.given = [0] * len(self.queues)  # episodes given to each engine in all
        self._lock = threading.Lock()

    def assign(self) -> int:
        """The engine a new episode's calls go to (counted open until `release`)."""
        with self._lock:
            engine = min(range(len(self.queues)), key=lambda k: (self.open[k], self.given[k], k))
            self.open[engine] += 1
            self.given[engine] += 1
            return engine

    def release(self, engine: int) -> None:
        with self._lock:
            self.open[engine] -= 1

    def submit(
        self, engine: int, prompt: Sequence[int], *, seed: int, max_new_tokens: int
    ) -> Future:
        """A future of the call's `Served` (sample and policy version) from ``engine``."""
        return self.queues[engine].submit(prompt, seed=seed, max_new_tokens=max_new_tokens)

    @property
    def batches(self) -> int:
        """Engine calls made so far, over every engine."""
        return sum(q.batches for q in self.queues)

    def close(self) -> None:
        for q in self.queues:
            q.close()
