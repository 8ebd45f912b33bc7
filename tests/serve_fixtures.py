"""A `unirl serve` for the tests: the server config on the tiny model, an in-process server on a
free loopback port, and the official SDK's client for it. Nothing here is a reference."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

API_KEY = "tml-unirl-test-key"
BASE = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_dict(folder: Path, state_dir: Path, port: int, **over: Any) -> dict[str, Any]:
    train = {"backend": "fsdp2", "progress": {"enabled": False}}
    return {
        "base_models": {BASE: str(folder)},
        "train": train,
        "state_dir": str(state_dir),
        "port": port,
        "api_key": API_KEY,
        **over,
    }


@contextmanager
def running_server(folder: Path, state_dir: Path, **over: Any) -> Iterator[tuple[str, Any]]:
    """(base URL, runtime) of a server running in this process until the block ends."""
    from unirl.serve.config import serve_config_from_dict
    from unirl.serve.server import build_server

    cfg = serve_config_from_dict(serve_dict(folder, state_dir, free_port(), **over))
    server, runtime = build_server(cfg)
    assert server is not None  # one process: it serves
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://{cfg.host}:{cfg.port}", runtime
    finally:
        server.should_exit = True
        thread.join()
        runtime.stop()
