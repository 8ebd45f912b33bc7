"""The OpenAI request and response bodies the gateway speaks, as plain functions (no server).

A request becomes prompt ids here: chat messages (and ``tools``) through the chat template,
rendered as text and encoded with the template's special tokens read as such (what vLLM's
server does); a completion's prompt is text (encoded with the tokenizer's own special tokens
unless ``add_special_tokens: false``) or a list of token ids, taken as they are. Sampling
settings are the run's (``rollout.temperature`` / ``rollout.top_p``: the trainer divides by the
same temperature); a call may ask for fewer tokens than ``rollout.max_new_tokens`` and for stop
strings of its own (the completion is cut after the token that completes one, as an engine
stops there). A completion's text is decoded from its ids; with ``tools`` in the request its
``<tool_call>{...}</tool_call>`` blocks become ``tool_calls`` (``tool_parser: hermes``).

vLLM's extensions are understood: ``return_token_ids`` (the prompt and completion ids in the
response), ``include_stop_str_in_output``, ``add_special_tokens``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs


class RequestError(Exception):
    """A request the gateway refuses: an HTTP ``status`` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.status}}  # fmt: skip


@attrs.frozen(kw_only=True)
class Sampling:
    """What one call may set: its token budget, its own stop strings, whether the stop string
    stays in the returned text."""

    max_tokens: int
    stop: tuple[str, ...] = ()
    include_stop: bool = False


@attrs.frozen(kw_only=True)
class Limits:
    """The run's sampling settings a request must agree with."""

    temperature: float
    top_p: float
    max_new_tokens: int
    max_seq_len: int


def sampling(body: Mapping[str, Any], limits: Limits, prompt_len: int) -> Sampling:
    """The call's settings from its body, checked against the run's; raises `RequestError`."""
    for key, run_value, run_key in (
        ("temperature", limits.temperature, "rollout.temperature"),
        ("top_p", limits.top_p, "rollout.top_p"),
    ):
        value = body.get(key)
        if value is not None and abs(float(value) - run_value) > 1e-9:
            raise RequestError(
                400,
                f"{key}={value}: the policy samples at {run_key}={run_value:g} (the trainer "
                f"scores tokens at the same setting); leave {key} out or set it to {run_value:g}",
                param=key,
            )
    if body.get("n", 1) != 1:
        raise RequestError(400, f"n={body.get('n')}: one completion per call; make n calls",
                           param="n")  # fmt: skip
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key)
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise RequestError(
            400,
            f"the prompt is {prompt_len} tokens, leaving no room under model.max_seq_len="
            f"{limits.max_seq_len} (context length exceeded); shorten the conversation",
            param="messages",
        )
    if asked is not None and (not isinstance(asked, int) or asked < 1):
        raise RequestError(400, f"{key}={asked!r}; give a positive integer", param=key)
    budget = min(limits.max_new_tokens, room, asked or limits.max_new_tokens)
    stop = body.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"stop={stop!r}; give non-empty strings", param="stop")
    return Sampling(max_tokens=budget, stop=tuple(stop),
                    include_stop=bool(body.get("include_stop_str_in_output", False)))  # fmt: skip


# -- prompts ----------------------------------------------------------------------------------


def _encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    out = tokenizer(text, add_special_tokens=special, split_special_tokens=False)
    return [int(t) for t in out["input_ids"]]


def chat_prompt_ids(tokenizer: Any, template: str | None, body: Mapping[str, Any]) -> list[int]:
    """The prompt ids of a chat request: its messages (and tools) through the chat template,
    with the opening of the assistant's turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] needs a string role", param="messages")
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            400,
            "the run's tokenizer has no chat template, so chat messages cannot be rendered; set "
            "rollout.agent.chat_template to a Jinja file, or call /v1/completions",
            param="messages",
        )
    kwargs = {"tools": body["tools"]} if body.get("tools") else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template, **kwargs
        )
    except Exception as exc:  # the template is user-supplied Jinja: it may raise anything
        raise RequestError(
            400, f"the chat template failed on these messages ({type(exc).__name__}: {exc})",
            param="messages",
        ) from None  # fmt: skip
    return _encode(tokenizer, text, special=False)


def completion_prompt_ids(tokenizer: Any, body: Mapping[str, Any], vocab_size: int) -> list[int]:
    """A completion request's prompt: token ids as given, or text encoded."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # one prompt in a list, as the SDK may send it
    if isinstance(prompt, str):
        ids = _encode(tokenizer, prompt, special=bool(body.get("add_special_tokens", True)))
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise RequestError(
            400, "prompt must be one text or one list of token ids (one prompt per call)",
            param="prompt",
        )  # fmt: skip
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(400, f"prompt holds token id {bad[0]}, outside [0, {vocab_size})",
                           param="prompt")  # fmt: skip
    if not ids:
        raise RequestError(400, "the prompt is empty", param="prompt")
    return ids


# -- completions ------------------------------------------------------------------------------


def cut_at_stop(ids: Sequence[int], stop: Sequence[str], decode: Any) -> tuple[int, str | None]:
    """How many of ``ids`` the completion keeps under the call's ``stop`` strings (through the
    token that completes the first one, as an engine stops there) and which stop ended it."""
    if not stop:
        return len(ids), None
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        hit = next((s for s in stop if s in text), None)
        if hit is not None:
            return n, hit
    return len(ids), None


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen tool calls: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    block whose JSON names a function becomes an OpenAI tool call; the text outside them is the
    content (None when empty). A block that is not such JSON stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _TOOL_CALL.finditer(text):
        try:
            value = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            continue
        arguments = value.get("arguments", {})
        calls.append({
            "id": f"{id_prefix}{len(calls)}",
            "type": "function",
            "function": {
                "name": value["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
            },
        })  # fmt: skip
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


@attrs.frozen(kw_only=True)
class Completion:
    """One call's answer, ready to be written as a response: its text, tool calls, ids, log-probs
    and why it ended."""

    call_id: str
    model: str
    text: str | None
    tool_calls: list[dict[str, Any]]
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    token_texts: list[str]
    finish_reason: str
    return_token_ids: bool

    def usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), len(self.completion_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _chat_logprobs(c: Completion) -> dict[str, Any]:
    return {"content": [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(c.token_texts, c.logprobs)
    ]}  # fmt: skip


def chat_body(c: Completion, *, logprobs: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": c.finish_reason,
                              "logprobs": _chat_logprobs(c) if logprobs else None}  # fmt: skip
    body = {"id": c.call_id, "object": "chat.completion", "created": int(time.time()),
            "model": c.model, "choices": [choice], "usage": c.usage()}  # fmt: skip
    if c.return_token_ids:
        choice["token_ids"] = c.completion_ids
        body["prompt_token_ids"] = c.prompt_ids
    return body


def completion_body(c: Completion, *, logprobs: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": c.text or "", "finish_reason": c.finish_reason,
                              "logprobs": None}  # fmt: skip
    if logprobs:
        choice["logprobs"] = {"tokens": c.token_texts, "token_logprobs": c.logprobs,
                              "top_logprobs": None, "text_offset": None}  # fmt: skip
    body = {"id": c.call_id, "object": "text_completion", "created": int(time.time()),
            "model": c.model, "choices": [choice], "usage": c.usage()}  # fmt: skip
    if c.return_token_ids:
        choice["token_ids"] = c.completion_ids
        choice["prompt_token_ids"] = c.prompt_ids
    return body


def _sse(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def chat_stream(c: Completion, *, logprobs: bool) -> Iterator[str]:
    """The chat answer as server-sent events: the role, the content a token at a time (or whole
    when tool calls were read from it), the tool calls, the finish reason, usage, [DONE]."""
    head = {"id": c.call_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": c.model}  # fmt: skip

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return _sse(head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                         **extra}]})  # fmt: skip

    yield chunk({"role": "assistant", "content": ""})
    if c.tool_calls:
        if c.text:
            yield chunk({"content": c.text})
        for i, call in enumerate(c.tool_calls):
            yield chunk({"tool_calls": [{"index": i, **call}]})
    else:
        for t, lp in zip(c.token_texts, c.logprobs):
            lps = ({"logprobs": {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                              "top_logprobs": []}]}} if logprobs else {})  # fmt: skip
            yield chunk({"content": t}, **lps)
    yield chunk({}, c.finish_reason)
    yield _sse(head | {"choices": [], "usage": c.usage()})
    yield "data: [DONE]\n\n"


def completion_stream(c: Completion) -> Iterator[str]:
    head = {"id": c.call_id, "object": "text_completion", "created": int(time.time()),
            "model": c.model}  # fmt: skip
    for t in c.token_texts:
        yield _sse(head | {"choices": [{"index": 0, "text": t, "finish_reason": None,
                                        "logprobs": None}]})  # fmt: skip
    yield _sse(head | {"choices": [{"index": 0, "text": "", "finish_reason": c.finish_reason,
                                    "logprobs": None}]})  # fmt: skip
    yield "data: [DONE]\n\n"
