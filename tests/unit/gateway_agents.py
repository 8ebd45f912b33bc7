"""Agent functions the gateway tests run (importable as ``tests.unit.gateway_agents:NAME``),
written as any agent program is: with the official ``openai`` SDK against a base URL."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import httpx
from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "the answer of the task",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]

# what the late agent's call after its episode ended got back: (status, error type)
LATE: dict[str, Any] = {}


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def tool_agent(base_url: str, task: dict[str, Any], api_key: str) -> float:
    """Three turns with a tool: each assistant message goes back as the gateway returned it
    (content and tool calls), then the tool's answer; the second turn streams."""
    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    for turn in range(3):
        if turn == 1:
            stream = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=6, stream=True
            )
            content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            message: dict[str, Any] = {"role": "assistant", "content": content}
        else:
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=6
            )
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages.append(message)
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": task["metadata"]["answer"]}
        )
    return 1.0 if task["metadata"]["answer"] in message.get("content", "") else 0.0


def fault_agent(base_url: str, task: dict[str, Any], api_key: str) -> Any:
    """One behaviour per prompt: ok, crash, hang, late (returns, then calls once more),
    burst (more calls at once than allowed)."""
    client = _client(base_url, api_key)
    kind = task["prompt"]

    def ask() -> Any:
        return client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": kind}], max_tokens=2
        )

    if kind == "burst":
        threads = [threading.Thread(target=lambda: _swallow(ask)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return 1.0
    ask()
    if kind == "crash":
        raise ValueError("the agent's tool broke")
    if kind == "hang":
        time.sleep(3600)
    if kind == "late":

        def call_late() -> None:
            time.sleep(0.5)
            r = httpx.post(
                base_url + "/chat/completions",
                headers={"Authorization": f"Bearer {api_key}"},
                json={"model": "policy", "messages": [{"role": "user", "content": kind}]},
            )
            LATE["reply"] = (r.status_code, r.json()["error"]["type"])

        threading.Thread(target=call_late, daemon=True).start()
    return 0.5


def _swallow(fn: Any) -> None:
    # the 429 is the gateway's answer; the episode's outcome is what the test reads
    with contextlib.suppress(Exception):
        fn()


def parity_agent(base_url: str, task: dict[str, Any], api_key: str) -> float:
    """One call; reward 1 when the reply has an odd length (so about half the groups of two
    differ in reward)."""
    reply = _client(base_url, api_key).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=4
    )
    return float(len(reply.choices[0].message.content or "") % 2)
