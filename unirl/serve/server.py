"""Run the server: the runtime (process group, worker) and uvicorn on ``host:port``; under
torchrun only rank 0 listens, the other ranks follow its backend calls (`unirl.serve.ranks`)."""

from __future__ import annotations

import logging

import uvicorn

from unirl.serve.app import make_app
from unirl.serve.config import ServeConfig
from unirl.serve.describe import describe_serve
from unirl.serve.runtime import Runtime

logger = logging.getLogger(__name__)


def build_server(cfg: ServeConfig) -> tuple[uvicorn.Server | None, Runtime]:
    """The uvicorn server (None on a rank other than 0) and the runtime behind it (started;
    `Runtime.stop` when done)."""
    runtime = Runtime(cfg)
    app = make_app(cfg, runtime)  # checks the API key before anything starts
    runtime.start()
    if not runtime.serving:
        return None, runtime
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning")
    return uvicorn.Server(config), runtime


def serve(cfg: ServeConfig) -> None:
    server, runtime = build_server(cfg)
    try:
        if server is None:
            runtime.follow()
            return
        logger.info(
            "unirl serve: http://%s:%d (%s)", cfg.host, cfg.port, ", ".join(cfg.base_models)
        )
        for key, value in describe_serve(cfg).items():
            logger.info("unirl serve: %s: %s", key, value)
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it stopped on: a normal stop
            logger.info("unirl serve: stopped (SIGINT)")
    finally:
        runtime.stop()
