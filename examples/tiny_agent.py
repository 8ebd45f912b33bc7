"""The agent of examples/tiny_agent.yaml: an ordinary OpenAI-client program with one tool.

The task hides a digit (``task["metadata"]["secret"]``) that only the tool knows. The agent
asks the model; a reply that is exactly ``c`` calls the tool, whose answer ``=<secret>`` goes
back as a tool message, and the model answers in its next turn. The first call earns 0.2, the
right answer 0.8: without the tool a policy can only guess (1 in 10). Point ``base_url`` and
``api_key`` at any OpenAI-compatible server and it runs the same.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from openai import OpenAI

CALL = "c"


@cache
def _client(base_url: str) -> OpenAI:
    """One client (one connection pool) per endpoint; each episode's key is set per call."""
    return OpenAI(base_url=base_url, api_key="unset", max_retries=0)


def lookup(secret: str) -> str:
    """The tool: it knows the secret."""
    return "=" + secret


def agent(base_url: str, task: dict[str, Any], api_key: str) -> float:
    client = _client(base_url).with_options(api_key=api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "?"}]
    reward, called = 0.0, False
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if text != CALL:  # the final answer
            return reward + (0.8 if text == task["metadata"]["secret"] else 0.0)
        if not called:
            reward, called = reward + 0.2, True
        messages.append({"role": "tool", "content": lookup(task["metadata"]["secret"])})
    return reward
