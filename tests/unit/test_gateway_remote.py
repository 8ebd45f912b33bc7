"""The channel from the gateway on rank 0 to an engine on another leader (gateway/remote.py),
and the queue that batches the agents' calls (gateway/engines.py): a late answer never reaches
the next batch, a silent peer blocks no other connection, a short answer fails its batch."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import pytest

from unirl.core.errors import RunError
from unirl.rollouts.gateway.engines import GenerationQueue
from unirl.rollouts.gateway.remote import EngineServer, RemoteCalls
from unirl.rollouts.serving.engine import EngineSample


class Echo:
    """A stand-in engine: each prompt's sample is the prompt's tokens + 100; the first batch
    answers after ``first_delay_s``."""

    def __init__(self, first_delay_s: float = 0.0) -> None:
        self.first_delay_s, self.batches = first_delay_s, 0

    def generate(
        self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_new_tokens: int
    ) -> list[EngineSample]:
        self.batches += 1
        if self.batches == 1:
            time.sleep(self.first_delay_s)
        return [
            EngineSample(
                response_tokens=tuple(t + 100 for t in p), logprobs=(0.0,) * len(p), finished=True
            )
            for p in prompts
        ]


def test_a_late_answer_is_not_taken_by_the_next_batch():
    """The leader answers the first batch after the call timed out on rank 0: the first batch
    fails with the timeout, and the second batch gets its own samples (its prompts + 100), not
    the first batch's (1, 2 -> 101, 102) that arrive on the old connection meanwhile."""
    server = EngineServer(Echo(first_delay_s=0.6), version=lambda: 3, lock=threading.Lock())
    remote = RemoteCalls(1, server.address, server.authkey, timeout_s=0.3)
    try:
        with pytest.raises(RunError, match=r"vLLM engine 1 did not answer .* within"):
            remote.generate([[1, 2]], [0], 4)
        remote.timeout_s = 30.0
        samples = remote.generate([[7, 8, 9]], [0], 4)
    finally:
        remote.close()
        server.close()
    assert [s.response_tokens for s in samples] == [(107, 108, 109)]
    assert remote.last_version == 3


def test_a_silent_peer_blocks_no_other_connection():
    """A peer that connects and sends nothing (a port scan, a stranger on the network) holds
    its own thread until the handshake's deadline; a real client connecting after it is served
    at once, and the silent one is cut at the deadline."""
    server = EngineServer(Echo(), version=lambda: 0, lock=threading.Lock(), handshake_s=1.0)
    silent = socket.create_connection(server.address, timeout=10)
    remote = RemoteCalls(1, server.address, server.authkey, timeout_s=5, handshake_s=5)
    answered: list[list[EngineSample]] = []
    caller = threading.Thread(
        target=lambda: answered.append(remote.generate([[1]], [0], 2)), daemon=True
    )
    try:
        time.sleep(0.1)  # the server accepted the silent peer first
        t0 = time.monotonic()
        caller.start()
        caller.join(timeout=10)
        served_s = time.monotonic() - t0
        assert answered and answered[0][0].response_tokens == (101,)
        assert served_s < 0.9  # before the silent peer's deadline: it did not wait for it
        silent.settimeout(10)
        # the silent peer is sent the challenge, then cut at its deadline (EOF after it)
        received = b""
        while chunk := silent.recv(4096):
            received += chunk
        assert b"#CHALLENGE#" in received
    finally:
        silent.close()
        remote.close()
        server.close()


def test_rank0_does_not_wait_forever_on_a_leader_that_says_nothing():
    """A leader's address that accepts the connection and never answers the handshake: rank
    0's connect ends at its deadline with an error naming the engine, instead of hanging."""
    mute = socket.create_server(("127.0.0.1", 0))
    remote = RemoteCalls(2, mute.getsockname(), b"k" * 32, timeout_s=30, handshake_s=0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(RunError, match=r"vLLM engine 2: the connection to its leader"):
            remote.generate([[1]], [0], 2)
    finally:
        mute.close()
    assert time.monotonic() - t0 < 5


def test_a_short_answer_fails_its_batch():
    """An engine that answers one sample fewer than a batch's calls: every call of the batch
    fails (none is left unanswered, none takes another call's sample), and the queue goes on
    with the next batch."""

    class Short:
        def generate(self, prompts, seeds, max_new_tokens):
            return [EngineSample(response_tokens=(5,), logprobs=(0.0,), finished=True)] * (
                len(prompts) - 1
            )

    queue = GenerationQueue(Short(), max_batch=8, version=lambda: 0, lock=threading.Lock())
    try:
        futures = [queue.submit([i], seed=i, max_new_tokens=1) for i in range(3)]
        for f in futures:  # (batched as the queue's thread found them: one sample short each)
            with pytest.raises(RunError, match=r"answered \d sample\(s\) to a batch of \d calls"):
                f.result(timeout=5)
    finally:
        queue.close()
