"""The HTTP routes the tinker SDK calls (``/api/v1/...``), on FastAPI.

Why FastAPI + uvicorn: the SDK is an HTTP/JSON (and protobuf) client with long polls; an ASGI
server with a thread pool for the blocking polls is the smallest thing that serves it, and both
are already the project's ``serve`` extra. Every route checks the API key (``X-API-Key``) and
the body size first; a request that changes state is checked in full, queued for the worker
and answered with a future (``request_id``) at once.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest
from unirl.serve.routes_sampling import add_sampling_routes
from unirl.serve.routes_training import add_training_routes
from unirl.serve.runtime import Runtime

# The SDK's feature flags for this server: API keys (no JWT exchange), plain httpx, protobuf
# bodies uncompressed, custom losses run client-side, one poll per sample.
CLIENT_CONFIG: dict[str, Any] = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "custom_loss_server_side": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "parallel_fwdbwd_chunks": True,
}


def _error(exc: BadRequest) -> JSONResponse:
    return JSONResponse({"detail": str(exc), "field": exc.field}, status_code=exc.status)


def make_app(cfg: ServeConfig, runtime: Runtime) -> FastAPI:
    """The app over ``runtime`` (worker, futures, sessions); the caller starts and stops it."""
    api_key = cfg.resolved_api_key()
    app = FastAPI(title="unirl serve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        sent = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(sent.encode(), api_key.encode()):
            return JSONResponse({"detail": "X-API-Key is missing or wrong"}, status_code=401)
        size = request.headers.get("content-length")
        if size is not None and int(size) > cfg.max_request_bytes:
            detail = f"body is {size} bytes, over serve.max_request_bytes={cfg.max_request_bytes}"
            return JSONResponse({"detail": detail, "field": "body"}, status_code=413)
        try:
            return await call_next(request)
        except BadRequest as exc:
            return _error(exc)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        return _error(exc)

    _add_service_routes(app)
    add_training_routes(app, cfg, runtime)
    add_sampling_routes(app, cfg, runtime)
    return app


def _add_service_routes(app: FastAPI) -> None:
    @app.get("/api/v1/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    def dynamic_config() -> dict[str, Any]:
        return {}

    @app.post("/api/v1/create_session")
    def create_session() -> dict[str, str]:
        return {"type": "create_session", "session_id": f"s{uuid.uuid4().hex[:12]}"}

    @app.post("/api/v1/session_heartbeat")
    def heartbeat() -> dict[str, str]:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/telemetry")
    def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    def finish(session_id: str) -> dict[str, str]:
        return {}
