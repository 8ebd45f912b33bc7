"""Training-client routes: create, info, forward / forward_backward, optim_step, save and
load state, save weights for the sampler, and the futures' ``retrieve_future``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from unirl.serve import state
from unirl.serve.config import ServeConfig
from unirl.serve.datums import token_datums
from unirl.serve.errors import BadRequest
from unirl.serve.jobs import CreateJob, FwdBwdJob, LoadJob, OptimJob, SaveJob
from unirl.serve.losses import sdk_loss
from unirl.serve.requests import adam_settings, json_body, require
from unirl.serve.runtime import Runtime, SamplingSession
from unirl.serve.sessions import base_model_folder, lora_section
from unirl.serve.wire import decode_forward_backward

# A poll waits this long for its result before answering try_again (the SDK waits 45 s).
POLL_WAIT_S = 20.0


def add_training_routes(app: FastAPI, cfg: ServeConfig, rt: Runtime) -> None:
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, str]:
        body = await json_body(request, cfg.max_request_bytes)
        base = require(body, "base_model", str)
        folder = base_model_folder(cfg, base)
        session_id = require(body, "session_id", str)
        model_id = f"{session_id}:train:{int(require(body, 'model_seq_id', int))}"
        if model_id in rt.sessions:
            raise BadRequest("model_seq_id", f"names {model_id!r}, which exists already")
        lora = lora_section(cfg, body)
        return rt.queue(CreateJob, model_id=model_id, base_model=base, weights=folder, lora=lora)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        body = await json_body(request, cfg.max_request_bytes)
        session = rt.sessions.get(require(body, "model_id", str))
        folder = str(cfg.base_model_folder(session.base_model))
        return {
            "type": "get_info",
            "model_id": session.model_id,
            "model_name": session.base_model,
            "is_lora": True,
            "lora_rank": int(session.lora["rank"]),
            "model_data": {"model_name": session.base_model, "tokenizer_id": folder},
        }

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, str]:
        raw = await request.body()
        if len(raw) > cfg.max_request_bytes:
            raise BadRequest(
                "body", f"is {len(raw)} bytes, over serve.max_request_bytes", status=413
            )
        req = decode_forward_backward(raw)
        session = rt.sessions.get(req.model_id)
        loss = sdk_loss(req.loss_fn)
        settings = loss.settings(req.loss_fn_config)
        if not req.data or len(req.data) > cfg.max_datums_per_request:
            raise BadRequest(
                "data", f"holds {len(req.data)} datums; send 1..{cfg.max_datums_per_request}"
            )
        vocab = session.backend.vocab_size
        datums = token_datums(
            req.data,
            loss,
            vocab_size=vocab,
            max_tokens=cfg.tokens_per_microbatch,
            records=rt.worker.stability,
        )
        return rt.queue(
            FwdBwdJob,
            model_id=req.model_id,
            loss_fn=req.loss_fn,
            settings=settings,
            forward_only=req.forward_only,
            datums=datums,
        )

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, str]:
        body = await json_body(request, cfg.max_request_bytes)
        model_id = rt.sessions.get(require(body, "model_id", str)).model_id
        return rt.queue(OptimJob, model_id=model_id, settings=adam_settings(body))

    _add_state_routes(app, cfg, rt)
    _add_future_routes(app, cfg, rt)


def _add_future_routes(app: FastAPI, cfg: ServeConfig, rt: Runtime) -> None:
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        body = await json_body(request, cfg.max_request_bytes)
        request_id = require(body, "request_id", str)
        if not rt.futures.known(request_id):
            raise BadRequest(
                "request_id", f"is {request_id!r}, which this server never issued", status=404
            )
        outcome = await run_in_threadpool(rt.futures.wait, request_id, POLL_WAIT_S)
        if outcome is None:
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        if outcome.proto is not None:
            return Response(outcome.proto, media_type="application/x-protobuf")
        if outcome.error is not None:
            return JSONResponse({"error": outcome.error, "category": outcome.category})
        return JSONResponse(outcome.json)


def _add_state_routes(app: FastAPI, cfg: ServeConfig, rt: Runtime) -> None:
    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, str]:
        body = await json_body(request, cfg.max_request_bytes)
        session = rt.sessions.get(require(body, "model_id", str))
        name = state.check_name(body.get("path") or rt.next_name("state"))
        path = state.StatePath(model_id=session.model_id, kind="weights", name=name)
        if path.folder(cfg.state_dir).exists() and not body.get("overwrite"):
            raise BadRequest("path", f"{name!r} is saved already; pick another name or overwrite")
        return rt.queue(SaveJob, model_id=session.model_id, path=path)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, str]:
        body = await json_body(request, cfg.max_request_bytes)
        session = rt.sessions.get(require(body, "model_id", str))
        name = state.check_name(body.get("path") or rt.next_name("sampler"))
        path = state.StatePath(model_id=session.model_id, kind="sampler_weights", name=name)
        sid = None
        if body.get("path") is None:  # save_weights_and_get_sampling_client
            weights = state.sampled_weights(path.folder(cfg.state_dir), cfg.sampling)
            sid = rt.add_sampling(
                SamplingSession(base_model=session.base_model, model_path=path.uri, weights=weights)
            )
        return rt.queue(SaveJob, model_id=session.model_id, path=path, sampling_session_id=sid)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, str]:
        body = await json_body(request, cfg.max_request_bytes)
        path = state.parse_path(require(body, "path", str))
        if path.kind != "weights":
            raise BadRequest("path", "names sampler weights; load a save_state path")
        folder = path.folder(cfg.state_dir)
        meta = state.read_meta(folder)
        optimizer = bool(require(body, "optimizer", bool))
        if body.get("model_id") is not None:
            model_id = rt.sessions.get(body["model_id"]).model_id
            base = None
        else:
            seq = int(require(body, "model_seq_id", int))
            model_id = f"{require(body, 'session_id', str)}:train:{seq}"
            base = body.get("base_model") or meta["base_model"]
            base_model_folder(cfg, base)
        return rt.queue(
            LoadJob,
            model_id=model_id,
            path=path,
            folder=folder,
            optimizer=optimizer,
            base_model=base,
        )
