"""An engine driven by another rank, as the gateway on global rank 0 calls it.

Several vLLM engines run where the vLLM source places them: engine k beside its leader, global
rank ``k * world / engines`` (`unirl.rollouts.serving.placement`), which starts it, syncs and
verifies its weights and restarts it when it dies. The gateway and the agents run on global rank
0 only; a leader k > 0 therefore serves its engine's calls (`EngineServer`: a thread answering
``(prompts, seeds, max_new_tokens)`` with the samples and the policy version its engine holds)
and rank 0 reaches it through `RemoteCalls`, a `CallEngine` like the local one. The channel is
Python's `multiprocessing.connection` (pickled objects over a socket, the peer authenticated by
an HMAC challenge on a random key of the engine), on loopback when every rank is on rank 0's
node, else on every interface, reached by the leader's host name. A leader serves under the lock its weight sync takes, so a
call never meets half-synced weights.

    server = EngineServer(calls, version=lambda: source.policy_version, lock=lock)   # leader k
    address, key = server.address, server.authkey    # gathered to rank 0 at the first rollout
    remote = RemoteCalls(k, address, key, timeout_s=3600)                             # rank 0
    samples = remote.generate(prompts, seeds, max_new_tokens)   # remote.last_version: its version
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from unirl.core.errors import RunError
from unirl.rollouts.gateway.engines import CallEngine
from unirl.rollouts.serving.engine import EngineSample

logger = logging.getLogger(__name__)


class EngineServer:
    """Serves ``calls`` (this leader's engine) to the gateway on rank 0, each connection on a
    thread of its own; `close` stops it."""

    def __init__(
        self,
        calls: CallEngine,
        *,
        version: Callable[[], int | None],
        lock: threading.Lock,
        host: str = "127.0.0.1",
    ) -> None:
        self.calls, self.version, self.lock = calls, version, lock
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener((host, 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept, name="unirl-engine-server", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except Exception:  # a failed handshake (a stranger), or the listener closed
                if self._closed:
                    return
                logger.warning("the engine server refused a connection", exc_info=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return
                if message is None:
                    return
                conn.send(self._answer(*message))

    def _answer(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], budget: int) -> Any:
        try:
            with self.lock:
                samples = self.calls.generate(prompts, seeds, budget)
                return ("ok", samples, self.version())
        except Exception as exc:  # answered: the call on rank 0 fails with it
            logger.debug("an agent's call failed on this engine", exc_info=True)
            return ("error", f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # wake the accept so that its thread ends
            Client(self.address, authkey=self.authkey).close()
        self._listener.close()
        self._thread.join(timeout=5)


class RemoteCalls:
    """Engine ``engine`` on its leader as a `CallEngine`: one connection, one batch at a time
    (its `GenerationQueue` thread is the only caller); ``last_version`` is the policy version
    the engine reported with the last batch."""

    def __init__(
        self, engine: int, address: tuple[str, int], authkey: bytes, *, timeout_s: float
    ) -> None:
        self.engine, self.address, self.authkey, self.timeout_s = (
            engine,
            address,
            authkey,
            timeout_s,
        )
        self.last_version: int | None = None
        self._conn: Connection | None = None

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]:
        if self._conn is None:
            self._conn = Client(self.address, authkey=self.authkey)
        self._conn.send(([tuple(p) for p in prompts], list(seeds), max_new_tokens))
        if not self._conn.poll(self.timeout_s):
            raise RunError(
                f"vLLM engine {self.engine} did not answer an agent's calls within "
                f"rollout.agent.vllm.generation_timeout_s={self.timeout_s:g} s; raise it, or "
                "look at the rank that drives it"
            )
        answer = self._conn.recv()
        if answer[0] == "error":
            raise RunError(f"vLLM engine {self.engine}: {answer[1]}")
        _, samples, self.last_version = answer
        return list(samples)

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._conn.close()
            self._conn = None
