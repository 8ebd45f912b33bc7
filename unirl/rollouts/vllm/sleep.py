"""vLLM's sleep mode between the phases of an RL step, so that a trainer and an engine share a GPU:
the engine sleeps while the trainer trains and wakes for the weight sync and the generation.

    cycle = SleepCycle(llm, "offload")      # rollout.vllm.sleep
    cycle.before_sync()                     # weights back (level 1) or reallocated (level 2)
    ... the sync writes every weight ...
    cycle.before_generate()                 # the KV cache back; the prefix cache dropped
    ... generate ...
    cycle.after_generate()                  # LLM.sleep(level): the trainer trains next

``offload`` is sleep level 1 (weights copied to host memory, KV cache discarded); ``discard`` is
level 2 (weights and KV cache discarded: the sync that follows rewrites every weight, so nothing
is lost and no host memory is used). Waking the weights before the sync and the KV cache only
after it follows vLLM's advice for RL (its ``wake_up(tags=["weights"])`` then
``["kv_cache"]``): the sync's buffers never meet a live KV cache. The engine must have been
started with ``enable_sleep_mode=True`` (`engine_kwargs`), which vLLM offers on CUDA only.
"""

from __future__ import annotations

from typing import Any

LEVELS = {"offload": 1, "discard": 2}


def engine_kwargs(mode: str) -> dict[str, Any]:
    """What `vllm.LLM` needs at start for ``rollout.vllm.sleep=mode``."""
    return {} if mode == "off" else {"enable_sleep_mode": True}


class SleepCycle:
    """The sleep / wake calls of one engine (``llm``: a `vllm.LLM`, or anything with its
    ``sleep(level)``, ``wake_up(tags)`` and ``reset_prefix_cache()``)."""

    def __init__(self, llm: Any, mode: str) -> None:
        self.llm = llm
        self.level = LEVELS.get(mode)  # None: off
        self._asleep: set[str] = set()  # "weights", "kv_cache"

    def before_sync(self) -> None:
        self._wake("weights")

    def before_generate(self) -> None:
        self._wake("weights")  # a generation without a sync before it (not in the RL loop)
        if "kv_cache" in self._asleep:
            self._wake("kv_cache")
            self.llm.reset_prefix_cache()

    def after_generate(self) -> None:
        if self.level is None:
            return
        self.llm.sleep(level=self.level)
        self._asleep = {"weights", "kv_cache"}

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)
