"""The gateway's HTTP endpoint: OpenAI's chat completions, completions and models, on FastAPI,
served by uvicorn on a thread of its own.

An agent reaches it at ``base_url`` (``http://127.0.0.1:PORT/v1``) with its episode's key as the
API key (``Authorization: Bearer KEY``, what the ``openai`` SDK sends), or at
``http://127.0.0.1:PORT/k/KEY/v1`` for a client that cannot set a header. The key is random per
episode: it authenticates the caller and names the episode its calls belong to. A request with
no known key gets 401; one with the key of an episode that has ended gets 410 (a late call,
logged and counted, never recorded); a body over ``rollout.agent.max_request_bytes`` 413; a call
past the episode's limits 429, and its episode ends as a failure. Each call is generated on its
episode's engine (`routing.EngineRouter`: one engine per episode) and recorded (`CallRecord`)
before it is answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from unirl.rollouts.gateway import protocol
from unirl.rollouts.gateway.engines import Served
from unirl.rollouts.gateway.plugin import AgentOptions
from unirl.rollouts.gateway.recording import CallRecord, EpisodeFailure, EpisodeRecord
from unirl.rollouts.gateway.routing import EngineRouter

logger = logging.getLogger(__name__)

MODEL_NAME = "unirl-policy"


class Gateway:
    """The endpoint's state: the open episodes by key, the engines' router, how requests become
    prompt ids. `start` serves it; `open_episode` / `end_episode` bracket each episode."""

    def __init__(
        self,
        *,
        router: EngineRouter,
        tokenizer: Any,
        limits: protocol.Limits,
        vocab_size: int,
        options: AgentOptions,
        chat_template: str | None = None,
    ) -> None:
        self.router, self.tokenizer, self.limits = router, tokenizer, limits
        self.vocab_size, self.options = vocab_size, options
        self.chat_template = chat_template
        self.episodes: dict[str, EpisodeRecord] = {}
        self.ended: dict[str, str] = {}  # key -> the episode it named
        self.late_calls = 0
        self._lock = threading.Lock()
        self.app = self._make_app()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.base_url = ""

    # -- episodes -------------------------------------------------------------------------

    def open_episode(self, where: str, *, seed: int) -> EpisodeRecord:
        record = EpisodeRecord(
            secrets.token_hex(16),
            where,
            seed=seed,
            max_calls=self.options.max_calls,
            max_in_flight=self.options.max_calls_in_flight,
            engine=self.router.assign(),
        )
        with self._lock:
            self.episodes[record.key] = record
        return record

    def end_episode(self, record: EpisodeRecord) -> list[CallRecord]:
        with self._lock:
            self.episodes.pop(record.key, None)
            self.ended[record.key] = record.where
        self.router.release(record.engine)
        return record.close()

    def _episode(self, request: Request, path_key: str | None) -> EpisodeRecord:
        key = path_key
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        with self._lock:
            record = self.episodes.get(key or "")
            ended = self.ended.get(key or "")
        if record is not None:
            return record
        if ended is not None:
            self.late_calls += 1
            logger.warning("a late call: %s had ended when its agent called again", ended)
            raise protocol.RequestError(
                410, f"{ended} has ended (its agent returned or timed out); a call after its "
                "episode ended is not recorded", kind="episode_ended",
            )  # fmt: skip
        raise protocol.RequestError(
            401, "no episode has this API key; use the key unirl gave the agent function",
            kind="authentication_error",
        )  # fmt: skip

    # -- calls ----------------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.options.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise protocol.RequestError(
                413, f"the request is {declared} bytes, over rollout.agent.max_request_bytes="
                f"{limit}", kind="request_too_large",
            )  # fmt: skip
        raw = await request.body()
        if len(raw) > limit:
            raise protocol.RequestError(
                413, f"the request is {len(raw)} bytes, over rollout.agent.max_request_bytes="
                f"{limit}", kind="request_too_large",
            )  # fmt: skip
        try:
            body = json.loads(raw)
        except ValueError:
            raise protocol.RequestError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise protocol.RequestError(400, "the body must be a JSON object")
        return body

    async def _call(self, endpoint: str, request: Request, path_key: str | None) -> Any:
        try:
            record = self._episode(request, path_key)
            body = await self._body(request)
            if endpoint == "chat":
                prompt = protocol.chat_prompt_ids(self.tokenizer, self.chat_template, body)
            else:
                prompt = protocol.completion_prompt_ids(self.tokenizer, body, self.vocab_size)
            settings = protocol.sampling(body, self.limits, len(prompt))
            try:
                index = record.begin_call()
            except EpisodeFailure as exc:
                raise protocol.RequestError(429, str(exc), kind=exc.outcome) from None
            completion = await self._generate(record, index, endpoint, prompt, settings, body)
        except protocol.RequestError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return self._respond(endpoint, completion, body)

    async def _generate(
        self,
        record: EpisodeRecord,
        index: int,
        endpoint: str,
        prompt: list[int],
        settings: protocol.Sampling,
        body: dict[str, Any],
    ) -> protocol.Completion:
        call: CallRecord | None = None
        try:
            future = self.router.submit(
                record.engine, prompt, seed=record.call_seed(index),
                max_new_tokens=settings.max_tokens,
            )  # fmt: skip
            served: Served = await asyncio.wrap_future(future)
            sample = served.sample
            keep, stop = protocol.cut_at_stop(sample.response_tokens, settings.stop, self._decode)
            ids = list(sample.response_tokens[:keep])
            call = CallRecord(
                index=index,
                endpoint=endpoint,
                prompt_ids=tuple(prompt),
                completion_ids=tuple(ids),
                logprobs=tuple(sample.logprobs[:keep]),
                finished=sample.finished or stop is not None,
                policy_version=served.policy_version,
                engine=record.engine,
            )
        except Exception as exc:
            logger.debug("gateway call failed", exc_info=True)
            raise protocol.RequestError(
                500, f"the engine failed ({type(exc).__name__}: {exc})", kind="server_error"
            ) from None
        finally:
            record.end_call(call)
        return self._completion(record, call, stop, settings, body)

    def _decode(self, ids: Any) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _completion(
        self,
        record: EpisodeRecord,
        call: CallRecord,
        stop: str | None,
        settings: protocol.Sampling,
        body: dict[str, Any],
    ) -> protocol.Completion:
        ids = list(call.completion_ids)
        text = self._decode(ids)
        if stop is not None and not settings.include_stop:
            text = text[: text.index(stop)]
        pieces: list[str] = []
        if body.get("stream") or body.get("logprobs"):
            # each token's text: what it adds to the decoded completion (cut where text ends)
            before = ""
            for n in range(1, len(ids) + 1):
                now = self._decode(ids[:n])
                pieces.append(now[len(before) :])
                before = now
            pieces = _cut_pieces(pieces, len(text))
        content: str | None = text
        tool_calls: list[dict[str, Any]] = []
        if body.get("tools") and self.options.tool_parser == "hermes":
            content, tool_calls = protocol.parse_tool_calls(
                text, f"call_{record.key[:8]}_{call.index}_"
            )
        finish = "tool_calls" if tool_calls else ("stop" if call.finished else "length")
        return protocol.Completion(
            call_id=f"unirl-{record.key[:8]}-{call.index}",
            model=str(body.get("model") or MODEL_NAME),
            text=content,
            tool_calls=tool_calls,
            prompt_ids=list(call.prompt_ids),
            completion_ids=ids,
            logprobs=list(call.logprobs),
            token_texts=pieces,
            finish_reason=finish,
            return_token_ids=bool(body.get("return_token_ids")),
        )

    def _respond(self, endpoint: str, c: protocol.Completion, body: dict[str, Any]) -> Any:
        logprobs = bool(body.get("logprobs"))
        if body.get("stream"):
            events = (
                protocol.chat_stream(c, logprobs=logprobs)
                if endpoint == "chat"
                else protocol.completion_stream(c)
            )
            return StreamingResponse(events, media_type="text/event-stream")
        if endpoint == "chat":
            return JSONResponse(protocol.chat_body(c, logprobs=logprobs))
        return JSONResponse(protocol.completion_body(c, logprobs=logprobs))

    # -- the app and its server -----------------------------------------------------------

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="unirl agent gateway", docs_url=None, redoc_url=None)

        async def models(request: Request, key: str | None = None) -> Any:
            try:
                self._episode(request, key)
            except protocol.RequestError as err:
                return JSONResponse(err.body(), status_code=err.status)
            return {"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "unirl"}]}  # fmt: skip

        async def chat(request: Request, key: str | None = None) -> Any:
            return await self._call("chat", request, key)

        async def completions(request: Request, key: str | None = None) -> Any:
            return await self._call("completion", request, key)

        for prefix in ("/v1", "/k/{key}/v1"):
            app.add_api_route(f"{prefix}/models", models, methods=["GET"])
            app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
            app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        return app

    def start(self) -> str:
        """Serve on ``rollout.agent.host`` / ``port`` (0: a free port); returns the base URL."""
        import uvicorn

        o = self.options
        config = uvicorn.Config(
            self.app,
            host=o.host,
            port=o.port,
            log_level="warning",
            access_log=False,
            # a connection limit beyond which uvicorn answers 503 (every episode's calls in flight)
            limit_concurrency=o.concurrency * o.max_calls_in_flight + 8,
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="unirl-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                from unirl.core.errors import ConfigError

                raise ConfigError(
                    f"the agent gateway could not listen on {o.host}:{o.port}; set "
                    "rollout.agent.port to a free port (0: any)"
                )
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        host = f"[{o.host}]" if ":" in o.host else o.host
        self.base_url = f"http://{host}:{port}/v1"
        logger.info("agent gateway on %s", self.base_url)
        return self.base_url

    def url_with_key(self, key: str) -> str:
        """The base URL that carries ``key`` in its path (for a client without headers)."""
        return self.base_url[: -len("/v1")] + f"/k/{key}/v1"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None


def _cut_pieces(pieces: list[str], length: int) -> list[str]:
    """The token pieces cut so that together they are the first ``length`` characters."""
    out, used = [], 0
    for p in pieces:
        take = p[: max(0, length - used)]
        out.append(take)
        used += len(take)
    return out
