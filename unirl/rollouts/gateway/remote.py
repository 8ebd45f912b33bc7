"""An engine driven by another rank, as the gateway on global rank 0 calls it.

Several vLLM engines run where the vLLM source places them: engine k beside its leader, global
rank ``k * world / engines`` (`unirl.rollouts.serving.placement`), which starts it, syncs and
verifies its weights and restarts it when it dies. The gateway and the agents run on global rank
0 only; a leader k > 0 therefore serves its engine's calls (`EngineServer`: a thread answering
``(prompts, seeds, max_new_tokens)`` with the samples and the policy version its engine holds)
and rank 0 reaches it through `RemoteCalls`, a `CallEngine` like the local one. The channel is
Python's `multiprocessing.connection` (pickled objects over a socket, the peer authenticated by
an HMAC challenge on a random key of the engine), on loopback when every rank is on rank 0's
node, else on every interface, reached by the leader's host name. A leader serves under the lock
its weight sync takes, so a call never meets half-synced weights.

Bounded both ways: the handshake runs on the connection's own thread within `HANDSHAKE_S` (a
peer on the network that connects and says nothing blocks no other connection), rank 0 connects
within it too, and a batch that gets no answer within the generation timeout drops its
connection, so the late answer never reaches the next batch (each answer also names its batch).

    server = EngineServer(calls, version=lambda: source.policy_version, lock=lock)   # leader k
    address, key = server.address, server.authkey    # gathered to rank 0 at the first rollout
    remote = RemoteCalls(k, address, key, timeout_s=3600)                             # rank 0
    samples = remote.generate(prompts, seeds, max_new_tokens)   # remote.last_version: its version
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import (
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from typing import Any

from unirl.core.errors import RunError
from unirl.rollouts.gateway.engines import CallEngine
from unirl.rollouts.serving.engine import EngineSample

logger = logging.getLogger(__name__)

# how long a connection's handshake may take, either side (a peer that connects and says nothing)
HANDSHAKE_S = 60.0


class EngineServer:
    """Serves ``calls`` (this leader's engine) to the gateway on rank 0, each connection on a
    thread of its own, which also runs the connection's handshake: a peer that connects and
    says nothing holds its own thread for ``handshake_s`` at most, never the accepting one;
    `close` stops it."""

    def __init__(
        self,
        calls: CallEngine,
        *,
        version: Callable[[], int | None],
        lock: threading.Lock,
        host: str = "127.0.0.1",
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        self.calls, self.version, self.lock = calls, version, lock
        self.handshake_s = handshake_s
        self.authkey = secrets.token_bytes(32)
        # no authkey here: `Listener.accept` would run the challenge on the accepting thread
        self._listener = Listener((host, 0))
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
            except OSError:  # the listener closed
                if self._closed:
                    return
                logger.warning("the engine server could not accept a connection", exc_info=True)
                continue
            if self._closed:
                conn.close()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            try:
                handshake(conn, self.authkey, server=True, timeout_s=self.handshake_s)
            except (AuthenticationError, EOFError, OSError):  # a stranger, or a silent peer
                if not self._closed:
                    logger.warning("the engine server refused a connection", exc_info=True)
                return
            while True:
                try:
                    message = conn.recv()
                    if message is None:
                        return
                    call, *request = message
                    conn.send((call, *self._answer(*request)))
                except (EOFError, OSError):  # rank 0 dropped the connection (a timed-out call)
                    return

    def _answer(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], budget: int
    ) -> tuple[Any, ...]:
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
            socket.create_connection(self.address, timeout=5).close()
        self._listener.close()
        self._thread.join(timeout=5)


class RemoteCalls:
    """Engine ``engine`` on its leader as a `CallEngine`: one connection, one batch at a time
    (its `GenerationQueue` thread is the only caller); ``last_version`` is the policy version
    the engine reported with the last batch.

    Each batch carries a number the answer must repeat, and a batch that fails on the way (no
    answer within ``timeout_s``, a broken connection) drops the connection: the leader's late
    answer to it can never be taken as the answer to the next batch."""

    def __init__(
        self,
        engine: int,
        address: tuple[str, int],
        authkey: bytes,
        *,
        timeout_s: float,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        self.engine, self.address, self.authkey = engine, address, authkey
        self.timeout_s, self.handshake_s = timeout_s, handshake_s
        self.last_version: int | None = None
        self._conn: Connection | None = None
        self._calls = 0  # batches sent: the number of the next one's answer

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]:
        self._calls += 1
        call = self._calls
        try:
            conn = self._connection()
            conn.send((call, [tuple(p) for p in prompts], list(seeds), max_new_tokens))
            if not conn.poll(self.timeout_s):
                raise RunError(
                    f"vLLM engine {self.engine} did not answer an agent's calls within "
                    f"rollout.agent.vllm.generation_timeout_s={self.timeout_s:g} s; raise it, "
                    "or look at the rank that drives it"
                )
            answer = conn.recv()
        except (EOFError, OSError) as exc:
            self._drop()
            raise RunError(
                f"vLLM engine {self.engine}: the connection to its leader at {self.address} "
                f"failed ({type(exc).__name__}: {exc}); look at the rank that drives it"
            ) from None
        except RunError:
            self._drop()
            raise
        if answer[0] != call:  # (cannot happen while every failed batch drops the connection)
            self._drop()
            raise RunError(f"vLLM engine {self.engine} answered batch {answer[0]}, not {call}")
        if answer[1] == "error":
            raise RunError(f"vLLM engine {self.engine}: {answer[2]}")
        _, _, samples, self.last_version = answer
        return list(samples)

    def _connection(self) -> Connection:
        """The connection to the leader, made (and authenticated) within ``handshake_s``."""
        if self._conn is None:
            sock = socket.create_connection(self.address, timeout=self.handshake_s)
            sock.setblocking(True)  # a Connection reads its file descriptor as is
            conn = Connection(sock.detach())
            try:
                handshake(conn, self.authkey, server=False, timeout_s=self.handshake_s)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop(self) -> None:
        """Close the connection without a word: the leader's thread for it ends at its EOF."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._drop()


def handshake(conn: Connection, authkey: bytes, *, server: bool, timeout_s: float) -> None:
    """`multiprocessing.connection`'s HMAC challenge both ways (as `Listener.accept` and
    `Client` run it), within ``timeout_s``: past it the connection is shut down, which ends a
    read that waits on a silent peer (`EOFError`), and the handshake raises `TimeoutError`."""
    handle = socket.socket(fileno=os.dup(conn.fileno()))  # the same connection, to shut it
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with contextlib.suppress(OSError):
            handle.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout_s, expire)
    timer.start()
    try:
        if server:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        else:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
    except (EOFError, OSError):
        if expired.is_set():
            raise TimeoutError(f"no handshake within {timeout_s:g} s") from None
        raise
    finally:
        timer.cancel()
        timer.join()
        handle.close()
    if expired.is_set():  # it came just as the handshake ended: the connection is shut
        raise TimeoutError(f"no handshake within {timeout_s:g} s")
