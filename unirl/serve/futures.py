"""The futures protocol: every queued request gets a ``request_id`` at once; the worker
completes it later; the SDK polls ``retrieve_future`` until the result is there.

A poll waits up to ``wait_s`` for the result (a long poll, under the SDK's 45 s request
timeout) instead of answering ``try_again`` at once, so a waiting client costs one request per
``wait_s``, not a busy loop."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import attrs


@attrs.define
class Outcome:
    """A finished request: a protobuf payload (``ForwardBackwardOutput``, ``SampleResponse``), a
    JSON body, or an error with the SDK's category (``user``: the request's fault)."""

    proto: bytes | None = None
    json: dict[str, Any] | None = None
    error: str | None = None
    category: str = "server"


class FutureStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._done: dict[str, Outcome] = {}
        self._events: dict[str, threading.Event] = {}

    def create(self) -> str:
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            self._events[request_id] = threading.Event()
        return request_id

    def complete(self, request_id: str, outcome: Outcome) -> None:
        with self._lock:
            self._done[request_id] = outcome
            event = self._events[request_id]
        event.set()

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._events

    def wait(self, request_id: str, wait_s: float) -> Outcome | None:
        """The outcome, or None while the request is still queued or running."""
        with self._lock:
            event = self._events[request_id]
        if not event.wait(wait_s):
            return None
        with self._lock:
            return self._done[request_id]
