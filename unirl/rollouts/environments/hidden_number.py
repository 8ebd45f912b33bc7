"""``hidden_number``: a tool task whose answer only the tool knows, the smallest test that a
policy learns to call a tool and use what it returns.

Every prompt is the same (``<bos> ? <sep>``, task ``tool_lookup``); each problem hides a digit in
its metadata (``secret``). A turn that is exactly the call string (default ``"c"``; make it a
``rollout.stop`` so the turn ends there) is a tool call: the observation is ``"=" + secret``, and
the first call earns ``call_reward`` (a per-turn reward: it makes calling worth learning before
the answer is). Any other turn is the final answer: ``1 - call_reward`` when its text is exactly
the secret, else 0 (no credit for a right first digit: a policy paid for it learns to copy the
digit and never to stop after it); an episode that calls once and answers right earns 1.
Without the tool a policy can only guess (about 1 in 10).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unirl.core.errors import ConfigError
from unirl.rollouts.data.tasks import TOOL_CALL
from unirl.rollouts.environments.base import Turn


class HiddenNumber:
    """The environment of one episode: the secret of its problem, the tool behind ``call``."""

    def __init__(self, call: str = TOOL_CALL, call_reward: float = 0.2) -> None:
        if not call:
            raise ConfigError("rollout.environment_options.call must be a non-empty string")
        if not 0 <= call_reward < 1:
            raise ConfigError(
                f"rollout.environment_options.call_reward={call_reward} must be in [0, 1)"
            )
        self.call, self.call_reward = call, float(call_reward)
        self.secret = ""
        self.called = False

    def reset(self, prompt: str, metadata: Mapping[str, Any]) -> None:
        if "secret" not in metadata:
            raise ConfigError(
                "hidden_number needs problems whose metadata holds 'secret' (rollout.task: "
                "tool_lookup)"
            )
        self.secret = str(metadata["secret"])
        self.called = False

    def step(self, turn: Turn) -> tuple[str | None, float, bool]:
        if turn.text == self.call:
            reward = 0.0 if self.called else self.call_reward
            self.called = True
            return "=" + self.secret, reward, False
        return None, 1.0 - self.call_reward if turn.text == self.secret else 0.0, True
