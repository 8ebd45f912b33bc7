"""Multi-turn episodes on vLLM (``rollout.source: vllm`` with ``rollout.environment``), token in
and token out.

Every turn of every episode still going is one request of a single ``LLM.generate`` call (so a
rollout's episodes advance together, one engine call per turn). A request's prompt is the
episode so far as token ids (`EngineRequest`: vLLM's ``TokensPrompt``): the problem's prompt,
the first observation, and every earlier turn's sampled ids and observation ids, never
re-tokenised text; vLLM's prefix cache (on, `VllmEngine.start`) finds the earlier turns' keys
and values, so a turn computes only what is new. The engine's sampled ids and their log-probs
(``processed_logprobs``: temperature applied) are appended as they come; observation tokens get
loss mask 0 and no rollout log-prob (`unirl.rollouts.environments.episodes`).

Seeds. Turn ``k`` of episode ``i`` of rollout ``r`` is drawn with vLLM seed ``hash(train.seed, r,
i, k)``: the same seed gives the same episodes whatever vLLM's batching (episodes drop out of
the batch as they end), and a resumed run redraws what the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from unirl.core.data.rollout import RolloutBatch
from unirl.rollouts.data.tasks import Problem, Task
from unirl.rollouts.environments.base import Environment
from unirl.rollouts.environments.episode_batch import episode_rollout, observation_encoder
from unirl.rollouts.environments.episodes import EpisodeLimits, EpisodeRunner
from unirl.rollouts.sampler import Generation
from unirl.rollouts.vllm.engine import EngineRequest, VllmEngine


def turn_seed(seed: int, rollout: int, episode: int, turn: int) -> int:
    """A 31-bit seed for turn ``turn`` of episode ``episode`` of rollout ``rollout``."""
    digest = hashlib.blake2b(f"{seed}:{rollout}:{episode}:{turn}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


class VllmEpisodes:
    """Plays one rollout's episodes on a `VllmEngine` (``environment`` builds one episode's
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
        """A turn's text as vLLM's detokenizer reads it: ids past the tokenizer read as
        nothing (the sampler's rule too)."""
        vocab = self.task.tokenizer.vocab_size
        return self.task.tokenizer.decode([t for t in ids if t < vocab])

    def rollout(
        self,
        engine: VllmEngine,
        problems: Sequence[Problem],
        *,
        group: int,
        rollout: int,
        rl_step: int,
        first_group: int,
        policy_version: int | None,
    ) -> RolloutBatch:
        """``group`` episodes per problem, played to the end on ``engine`` (the source
        advances the generation bar when the rollout is complete)."""

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
            return [
                Generation(
                    response_tokens=torch.tensor(s.response_tokens, dtype=torch.long),
                    logprobs=torch.tensor(s.logprobs, dtype=torch.float32),
                    finished=s.finished,
                )
                for s in engine.generate(requests)
            ]

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
        )
