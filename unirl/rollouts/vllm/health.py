"""Whether a vLLM engine is alive and answering, watched wherever the trainer waits for it.

vLLM's calls block until the engine core answers: a core that was killed (out of memory, a
signal) or that stopped making progress (stopped, wedged) leaves the caller waiting for ever, or
until ``rollout.vllm.generation_timeout_s`` (an hour). So every blocking call into the engine
(`WATCHED`: generate, a weight sync's calls, sleep mode's; `WATCHED_ENGINE`: the LoRA adapters')
runs in a thread of its own while the caller polls the engine: any of its processes gone is a dead engine, noticed within `POLL_S`; no
engine step and no call returned for ``rollout.vllm.stall_timeout_s`` is a hung engine. Either
raises `EngineFailure`, which the source answers with a restart (source.py) up to
``rollout.vllm.max_restarts``. The engine is alive or not by its processes, not by vLLM's own
errors: a killed core can leave vLLM's client waiting with no error at all.

    watch = EngineWatch(pids, stall_timeout_s=60.0)
    watch.install(llm)          # llm's WATCHED methods now fail instead of waiting for ever
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from unirl.core.errors import RunError

logger = logging.getLogger(__name__)

POLL_S = 0.2
SETTLE_S = 1.0

# The `vllm.LLM` methods that wait for the engine core (generation, the file reload, sleep mode,
# the ipc / nccl weight transfer).
WATCHED = (
    "generate",
    "collective_rpc",
    "reset_prefix_cache",
    "sleep",
    "wake_up",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)
# The `llm.llm_engine` methods that wait for the engine core: the LoRA adapters (unirl serve's
# sampler weights, unirl train's policy versions under model.lora).
WATCHED_ENGINE = ("add_lora", "remove_lora", "list_loras")


class EngineFailure(RunError):
    """The engine died (``kind="died"``: a process of it gone) or stopped answering
    (``kind="hung"``: no progress within ``rollout.vllm.stall_timeout_s``)."""

    def __init__(self, kind: Literal["died", "hung"], detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


class EngineWatch:
    """The engine's processes and its progress: a step of the engine or a call that returned."""

    def __init__(self, pids: set[int], *, stall_timeout_s: float) -> None:
        self.pids = set(pids)
        self.stall_timeout_s = stall_timeout_s
        self.failed: EngineFailure | None = None  # once failed, every later call fails at once
        self._last_progress = time.monotonic()

    def progressed(self) -> None:
        self._last_progress = time.monotonic()

    def install(self, llm: Any) -> None:
        """Watch ``llm``'s blocking calls; an engine step counts as progress (vLLM's
        ``LLM._run_engine`` calls ``llm_engine.step()`` once per scheduler step)."""
        step = llm.llm_engine.step

        def counted_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            self.progressed()
            return out

        llm.llm_engine.step = counted_step
        for name in WATCHED:
            setattr(llm, name, self.watched(getattr(llm, name), name))
        for name in WATCHED_ENGINE:
            setattr(llm.llm_engine, name, self.watched(getattr(llm.llm_engine, name), name))

    def watched(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(fn, *args, what=name, **kwargs)

        return call

    def call(self, fn: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a daemon thread, the engine checked every `POLL_S` until
        it returns. A failed engine's thread is left blocked (the engine is killed by whoever
        catches `EngineFailure`: `VllmEngine.close`)."""
        self.check(what, stall=False)  # an engine idle while the trainer trained is not hung
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # handed to the caller's thread
                result["error"] = exc

        self.progressed()
        thread = threading.Thread(target=run, name=f"vllm-{what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive():
                self.check(what)
        self.progressed()
        if "error" in result:
            self._settle(what)  # vLLM's error may come before the death shows: that death
            raise result["error"]
        return result.get("value")

    def _settle(self, what: str) -> None:
        """Raise `EngineFailure` if a process of the engine is gone within `SETTLE_S`: an error
        vLLM raises because its engine died (EngineDeadError) is that death."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            self.check(what, stall=False)
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)

    def check(self, what: str = "", *, stall: bool = True) -> None:
        """Raise `EngineFailure` if a process of the engine is gone or (``stall``) the engine
        made no progress for ``stall_timeout_s``."""
        if self.failed is not None:
            raise self.failed
        gone = _gone(self.pids)
        if gone:
            self.failed = EngineFailure(
                "died", f"its process {min(gone)} is gone (killed, or out of memory)"
            )
        elif stall and time.monotonic() - self._last_progress > self.stall_timeout_s:
            self.failed = EngineFailure(
                "hung",
                f"it made no progress for rollout.vllm.stall_timeout_s="
                f"{self.stall_timeout_s:g} s (alive but not answering)",
            )
        if self.failed is not None:
            logger.warning("vLLM engine, in %s: %s", what or "a call", self.failed.detail)
            raise self.failed


def _gone(pids: set[int]) -> set[int]:
    """The processes of ``pids`` that no longer run (exited, or a zombie not yet reaped)."""
    import psutil  # a vLLM dependency

    gone = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                gone.add(pid)
        except psutil.NoSuchProcess:
            gone.add(pid)
    return gone
