"""Multi-turn episodes on a served engine (``rollout.environment`` with a serving source such as
``rollout.source: vllm``), token in and token out; any `TokenEngine` plays them.

Every turn of every episode still going is one request of a single ``generate`` call (so a
rollout's episodes advance together, one engine call per turn). A request's prompt is the
episode so far as token ids (`EngineRequest`): the problem's prompt, the first observation, and
every earlier turn's sampled ids and observation ids, never re-tokenised text; an engine with a
prefix cache (vLLM's, on in `VllmEngine.start`) finds the earlier turns' keys and values, so a
turn computes only what is new. The engine's sampled ids and their log-probs (temperature
applied) are appended as they come; observation tokens get loss mask 0 and no rollout log-prob
(`unirl.rollouts.environments.episodes`).

Seeds. Turn ``k`` of episode ``i`` of rollout ``r`` is drawn with seed ``hash(train.seed, r, i,
k)``: the same seed gives the same episodes whatever the engine's batching (episodes drop out of
the batch as they end), and a resumed run redraws what the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from unirl.core.config.sections.rollout_shaping import OverlongConfig
from unirl.core.data.rollout import RolloutBatch
from unirl.rollouts.data.stops import stop_text
from unirl.rollouts.data.tasks import Problem, Task
from unirl.rollouts.environments.base import Environment
from unirl.rollouts.environments.episode_batch import episode_rollout, observation_encoder
from unirl.rollouts.environments.episodes import EpisodeLimits, EpisodeRunner
from unirl.rollouts.sampler import Generation
from unirl.rollouts.serving.engine import EngineRequest, TokenEngine, as_generation


def turn_seed(seed: int, rollout: int, episode: int, turn: int) -> int:
    """A 31-bit seed for turn ``turn`` of episode ``episode`` of rollout ``rollout``."""
    digest = hashlib.blake2b(f"{seed}:{rollout}:{episode}:{turn}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


class ServedEpisodes:
    """Plays one rollout's episodes on a `TokenEngine` (``environment`` builds one episode's
    environment; ``max_model_len`` bounds prompt + response, as the engine does)."""

    def __init__(
        self,
        task: Task,
        environment: Callable[[], Environment],
        limits: EpisodeLimits,
        *,
        max_model_len: int,
        vocab_size: int,
        seed: int,
    ) -> None:
        self.task, self.environment, self.seed = task, environment, seed
        self.limits, self.max_model_len, self.vocab_size = limits, max_model_len, vocab_size
        self.encode = observation_encoder(task.tokenizer)

    def _decode(self, ids: Sequence[int]) -> str:
        """A turn's text as an engine's detokenizer reads it (`stop_text`)."""
        return stop_text(self.task.tokenizer, ids)

    def rollout(
        self,
        engine: TokenEngine,
        problems: Sequence[Problem],
        *,
        group: int,
        rollout: int,
        rl_step: int,
        first_group: int,
        policy_version: int | None,
        overlong: OverlongConfig | None = None,
    ) -> RolloutBatch:
        """``group`` episodes per problem, played to the end on ``engine`` (the source
        advances the generation bar when the rollout is complete); ``overlong``: DAPO's
        penalty against each episode's token budget."""

        def generate(
            prompts: Sequence[Sequence[int]], _bar: object, keys: Sequence[tuple[int, int]]
        ) -> list[Generation]:
            requests = [
                EngineRequest(
                    prompt_tokens=tuple(int(t) for t in prompt),
                    seed=turn_seed(self.seed, rollout, episode, turn),
                )
                for prompt, (episode, turn) in zip(prompts, keys)
            ]
            return [as_generation(s) for s in engine.generate(requests)]

        runner = EpisodeRunner(
            generate,
            encode=self.encode,
            decode=self._decode,
            limits=self.limits,
            max_seq_len=self.max_model_len,
            vocab_size=self.vocab_size,
        )
        return episode_rollout(
            runner,
            self.environment,
            problems,
            group=group,
            rl_step=rl_step,
            first_group=first_group,
            task_name=self.task.name,
            decode=self.task.tokenizer.decode,
            policy_version=policy_version,
            overlong=overlong,
        )
