"""One rollout of multi-turn episodes as a `RolloutBatch`, the same for every engine: an episode
per sample (``samples_per_prompt`` per problem, one ``group_id`` per problem), all played
together by an `EpisodeRunner` (whose ``generate`` is the engine's), each sample holding the
episode's ids, mask, log-probs, per-turn token rewards and its ``metadata["episode"]``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from unirl.core.config.sections.rollout_shaping import OverlongConfig
from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.errors import ConfigError
from unirl.core.progress.bars import GenerationProgress
from unirl.rollouts.data.tasks import Problem, TaskTokenizer
from unirl.rollouts.environments.base import Environment
from unirl.rollouts.environments.episodes import Episode, EpisodeRunner
from unirl.rollouts.shaping.overlong import overlong_penalty


def observation_encoder(tokenizer: TaskTokenizer) -> Callable[[str], list[int]]:
    """How an observation's text becomes ids: the task tokenizer's plain encoding (no special
    tokens added), done once per observation."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return lambda text: [int(t) for t in hf.encode(text, add_special_tokens=False)]
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        raise ConfigError(
            f"rollout.environment: the task's tokenizer ({type(tokenizer).__name__}) has no "
            "encode(text); return observations as token ids, or give the task a tokenizer with one"
        )
    return lambda text: list(encode(text))


def episode_rollout(
    runner: EpisodeRunner,
    environment: Callable[[], Environment],
    problems: Sequence[Problem],
    *,
    group: int,
    rl_step: int,
    first_group: int,
    task_name: str,
    decode: Callable[[Sequence[int]], str],
    policy_version: int | None,
    progress: GenerationProgress | None = None,
    overlong: OverlongConfig | None = None,
) -> RolloutBatch:
    """Play ``group`` episodes per problem (episode ``i`` answers problem ``i // group``, group
    id ``first_group + i // group``); the reward is the environment's, not the task's, plus
    ``overlong``'s penalty (`_overlong_fields`)."""
    sample_problems = [problems[i // group] for i in range(len(problems) * group)]
    episodes = []
    for i, problem in enumerate(sample_problems):
        # "RL step N" counts from 1, as the metrics and the progress bar do
        where = f"RL step {rl_step + 1} episode {i} (group {first_group + i // group})"
        episodes.append(
            runner.start(
                environment(),
                problem.prompt_tokens,
                problem.prompt_text,
                dict(problem.metadata),
                where,
                index=i,
            )
        )
    runner.run(episodes, progress)
    samples = []
    for i, (ep, problem) in enumerate(zip(episodes, sample_problems)):
        metadata = {
            "task": task_name,
            "rl_step": rl_step,
            "prompt": problem.prompt_text,
            "target": problem.target_text,
            "response": decode(ep.response),
            "finished": not ep.truncated,
            "episode": ep.metadata(),
        }
        if problem.metadata:
            metadata["prompt_metadata"] = dict(problem.metadata)
        fields = ep.sample_fields()
        if overlong is not None and overlong.buffer_tokens and ep.failed is None:
            metadata |= _overlong_fields(ep, fields, overlong)
        samples.append(
            RolloutSample(
                **fields,
                group_id=first_group + i // group,
                policy_version=policy_version,
                metadata=metadata,
            )
        )
    return RolloutBatch(tuple(samples))


def _overlong_fields(
    ep: Episode, fields: dict[str, Any], config: OverlongConfig
) -> dict[str, float]:
    """DAPO's soft overlong penalty for an episode: its response (turns and observations) against
    its own token budget (``rollout.max_episode_tokens``, within the model's length), so an
    episode cut at the budget gets the full penalty. Added to the reward and to the last token's
    reward (the per-turn token rewards keep summing to the reward); returns the metadata that
    logs it beside the task reward."""
    penalty = overlong_penalty(len(ep.response), max_new_tokens=ep.limit, config=config)
    task_reward = float(fields["reward"])
    fields["reward"] = task_reward + penalty
    if len(ep.response):
        fields["token_rewards"][-1] += penalty
    return {"task_reward": task_reward, "overlong_penalty": penalty}
