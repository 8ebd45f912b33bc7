"""An agent that breaks on demand (tests/faults/test_run_faults.py): the example agent
(examples/tiny_agent.py) until the file ``UNIRL_AGENT_FLAG`` names exists, then it calls the
model once and raises (``UNIRL_AGENT_HOW=raise``) or never returns (``hang``)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from openai import OpenAI


def agent(base_url: str, task: dict[str, Any], api_key: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "?"}], max_tokens=3
    )
    if Path(os.environ["UNIRL_AGENT_FLAG"]).exists():
        if os.environ["UNIRL_AGENT_HOW"] == "raise":
            raise ValueError("the agent's tool broke")
        time.sleep(3600)
    return float(reply.choices[0].message.content == task["metadata"]["secret"])
