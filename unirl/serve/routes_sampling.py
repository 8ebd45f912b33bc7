"""Sampling routes: sampling sessions (on a base model or saved sampler weights) and
``asample`` (``sample`` and ``compute_logprobs`` in the SDK), queued like training requests."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from unirl.serve import state
from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest
from unirl.serve.jobs import SampleWork
from unirl.serve.requests import json_body, require
from unirl.serve.runtime import Runtime, SamplingSession
from unirl.serve.sampling import flag, sample_job
from unirl.serve.sessions import base_model_folder
from unirl.serve.stability import sequence_id
from unirl.serve.vllm_params import check_sample


def _session_for(cfg: ServeConfig, body: dict[str, Any]) -> SamplingSession:
    if body.get("model_path"):
        path = state.parse_path(body["model_path"], "model_path")
        folder = path.folder(cfg.state_dir)
        meta = state.read_meta(folder, "model_path")
        # the built-in sampler loads the merged weights; vLLM the adapter (and its fingerprint)
        part = state.ADAPTER if cfg.sampling == "vllm" else state.HF
        if path.kind != "sampler_weights" or not (folder / part).is_dir():
            raise BadRequest(
                "model_path",
                f"is {path.uri!r}, which holds no sampler weights for serve.sampling="
                f"{cfg.sampling} (its {part}/ folder; saved by save_weights_for_sampler on a "
                "server with the same serve.sampling); save them again here",
            )
        weights = state.sampled_weights(folder, cfg.sampling)
        return SamplingSession(base_model=meta["base_model"], model_path=path.uri, weights=weights)
    base = require(body, "base_model", str)
    return SamplingSession(base_model=base, model_path=None, weights=base_model_folder(cfg, base))


def add_sampling_routes(app: FastAPI, cfg: ServeConfig, rt: Runtime) -> None:
    @app.get("/api/v1/get_server_capabilities")
    def capabilities() -> dict[str, Any]:
        models = [
            {"model_name": name, "trainable": True, "sampleable": True} for name in cfg.base_models
        ]
        return {"supported_models": models}

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, str]:
        body = await json_body(request, cfg.max_request_bytes)
        sid = rt.add_sampling(_session_for(cfg, body))
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get("/api/v1/samplers/{sampler_id}")
    def get_sampler(sampler_id: str) -> dict[str, Any]:
        session = rt.get_sampling(sampler_id, "sampler_id")
        return {
            "sampler_id": sampler_id,
            "base_model": session.base_model,
            "model_path": session.model_path,
        }

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await json_body(request, cfg.max_request_bytes)
        if body.get("sampling_session_id"):
            session = rt.get_sampling(body["sampling_session_id"])
        else:
            session = _session_for(cfg, body)
        saved = session.weights if cfg.sampling == "vllm" else session.weights.parent  # meta.json
        if session.model_path is not None and not saved.joinpath(state.META).is_file():
            raise BadRequest("sampling_session_id", "names sampler weights not saved (yet)")
        job = sample_job(
            body,
            session.weights,
            base_model=session.base_model,
            model_path=session.model_path,
            max_sample_tokens=cfg.max_sample_tokens,
            seeds=rt.seeds,
            top_k=cfg.sampling == "vllm",
        )
        if cfg.sampling == "vllm":
            check_sample(job)
        record = flag(body, "record_stability_info")
        answer: dict[str, Any] = rt.queue(SampleWork, job=job, record_stability=record)
        # the SDK stamps each sampled sequence with one of these ids
        ids = [sequence_id(answer["request_id"], i) for i in range(job.num_samples)]
        return {**answer, "sample_sequence_ids": ids}
