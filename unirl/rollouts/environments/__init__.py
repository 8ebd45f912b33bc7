"""Environments for multi-turn rollouts: the policy writes a turn, the environment answers with an
observation (a tool's output, a game's next state), and only the policy's tokens are trained.

``rollout.environment`` names a registered environment (``hidden_number``) or a class given as
``"package.module:Class"``; ``rollout.environment_options`` are its constructor's keyword
arguments. One instance is built per episode (`make_environment`), so an environment may keep
the episode's state on itself. The interface (`Environment`)::

    class MyTool:
        def __init__(self, **options): ...
        def reset(self, prompt: str, metadata: dict) -> Observation | str | list[int] | None:
            ...  # the first observation, appended to the prompt (None: nothing)
        def step(self, turn: Turn) -> tuple[observation, float, bool]:
            ...  # (observation appended after the turn, this turn's reward, episode done)

``turn.token_ids`` are the ids the engine sampled (never re-encoded), ``turn.text`` their
decoded text. An observation given as text is tokenised once by the run's tokenizer; one given
as token ids is appended as is. The episode loop is `unirl.rollouts.environments.episodes`.
"""

from unirl.rollouts.environments.base import Environment, Observation, Turn, as_observation
from unirl.rollouts.environments.registry import (
    ENVIRONMENTS,
    environment_factory,
    make_environment,
    register_environment,
)

__all__ = [
    "ENVIRONMENTS",
    "Environment",
    "Observation",
    "Turn",
    "as_observation",
    "environment_factory",
    "make_environment",
    "register_environment",
]
