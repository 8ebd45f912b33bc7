"""A rollout source that lives in the test suite, not in unirl: proof that a new source plugs in
without an edit under ``unirl/core``, ``unirl/cli.py`` or ``unirl/log_setup.py``.

`ToyRolloutSource` generates from the weights of `tests.plugins.toy_backend.ToyLM` (embedding ->
tanh -> output layer) in this process. It registers as ``rollout.source: toy`` with its own
section (``rollout: {toy: {response_length: 4, lag: 1}}``), its own rule (the responses fit
``rollout.max_new_tokens``), what ``unirl check`` prints about it and its engine's logger and
log-level variable. With ``lag: n`` it generates from the weights of ``n`` syncs ago, as an
asynchronous engine would, and says so: each sample's ``policy_version`` is that of the weights
it came from. Its weight queue is not saved with a checkpoint (a resumed run starts it anew).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from unirl.core.config.run_config import UnirlConfig
from unirl.core.config.validators import non_negative, positive
from unirl.core.data.rollout import RolloutBatch, RolloutSample
from unirl.core.errors import ConfigError, RunError
from unirl.core.progress.bars import GenerationProgress
from unirl.core.protocols.source_plugin import SourcePlugin
from unirl.core.weights.stream import HOST, Bucket
from unirl.rollouts.build import build_task
from unirl.rollouts.data.tasks import Task, load_task_state, task_rewards, task_state

LOGGER = "toy_engine"
LOG_LEVEL_ENV = "TOY_ENGINE_LOG_LEVEL"
logger = logging.getLogger(LOGGER)


@attrs.frozen(kw_only=True)
class ToySourceOptions:
    """The ``rollout.toy`` section."""

    response_length: int = attrs.field(default=4, validator=positive)
    # Generate from the weights of this many syncs ago (0: the last sync, on-policy).
    lag: int = attrs.field(default=0, validator=non_negative)


def check(cfg: UnirlConfig) -> None:
    o = cfg.rollout.source_options
    if o.response_length > cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"rollout.toy.response_length={o.response_length} exceeds rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}; lower it"
        )


def describe(cfg: UnirlConfig) -> Mapping[str, Any]:
    o = cfg.rollout.source_options
    return {
        "engine": f"toy: {o.response_length} tokens per response from a ToyLM in this process",
        "policy_version": f"the weights of {o.lag} sync(s) before the last",
    }


def toy_logprobs(
    weights: Mapping[str, torch.Tensor], tokens: torch.Tensor, t: float
) -> torch.Tensor:
    """ToyLM's next-token log-probs ``[T, V]`` at temperature ``t`` (each position sees only
    its own token)."""
    hidden = torch.tanh(weights["embed.weight"][tokens])
    return torch.log_softmax((hidden @ weights["head.weight"].T + weights["head.bias"]) / t, -1)


class ToyRolloutSource:
    """`unirl.rollouts.source.RolloutSource` sampling ``response_length`` tokens per response
    from the weights ``lag`` syncs old."""

    def __init__(self, task: Task, cfg: UnirlConfig) -> None:
        self.task = task
        self.options: ToySourceOptions = cfg.rollout.source_options
        self.temperature = cfg.rollout.temperature
        self.prompts_per_rollout = cfg.batch.prompts_per_rollout
        self.samples_per_prompt = cfg.batch.samples_per_prompt
        self._prompt_rng = random.Random(cfg.train.seed)
        self._generator = torch.Generator().manual_seed(cfg.train.seed)
        self._rollouts_drawn = 0
        # (policy_version, weights) of the last lag + 1 syncs, oldest first
        self._weights: deque[tuple[int, dict[str, torch.Tensor]]] = deque(
            maxlen=self.options.lag + 1
        )

    @property
    def num_rollouts(self) -> None:
        return None

    @property
    def vocab_size(self) -> int | None:
        return int(self._weights[-1][1]["head.bias"].numel()) if self._weights else None

    @property
    def weights_device(self) -> torch.device:
        return HOST  # the toy engine generates on the CPU

    def sync_weights(self, buckets: Iterable[Bucket], *, policy_version: int) -> None:
        weights = {k: v.detach().clone() for bucket in buckets for k, v in bucket}
        self._weights.append((policy_version, weights))
        logger.info("toy engine: weights of version %d received", policy_version)

    def next_rollout(
        self, rl_step: int, progress: GenerationProgress | None = None
    ) -> RolloutBatch:
        if not self._weights:
            raise RunError("ToyRolloutSource.next_rollout before sync_weights")
        version, weights = self._weights[0]
        group = self.samples_per_prompt
        problems = [
            self.task.sample_problem(self._prompt_rng) for _ in range(self.prompts_per_rollout)
        ]
        first_group = self._rollouts_drawn * self.prompts_per_rollout
        samples = []
        responses = []
        logprobs = []
        for i in range(len(problems) * group):
            tokens = list(problems[i // group].prompt_tokens)
            picked = []
            for _ in range(self.options.response_length):
                logp = toy_logprobs(weights, torch.tensor(tokens[-1:]), self.temperature)[0]
                token = int(torch.multinomial(logp.exp(), 1, generator=self._generator))
                tokens.append(token)
                picked.append(float(logp[token]))
            responses.append(tokens[len(problems[i // group].prompt_tokens) :])
            logprobs.append(picked)
        sample_problems = [problems[i // group] for i in range(len(responses))]
        rewards = task_rewards(self.task, sample_problems, responses)
        for i, (problem, response) in enumerate(zip(sample_problems, responses)):
            samples.append(
                RolloutSample(
                    prompt_tokens=list(problem.prompt_tokens),
                    response_tokens=response,
                    reward=rewards[i],
                    group_id=first_group + i // group,
                    rollout_logprobs=logprobs[i],
                    policy_version=version,
                )
            )
        self._rollouts_drawn += 1
        if progress is not None:
            progress.update(samples=len(samples), tokens=sum(map(len, responses)))
        return RolloutBatch(tuple(samples))

    def state_dict(self) -> dict[str, Any]:
        return {
            "source": "toy",
            "rollouts_drawn": self._rollouts_drawn,
            "prompt_rng": self._prompt_rng.getstate(),
            "generator": self._generator.get_state(),
            "task_state": task_state(self.task),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version, internal, gauss = state["prompt_rng"]
        self._prompt_rng.setstate((version, tuple(internal), gauss))
        self._generator.set_state(state["generator"])
        load_task_state(self.task, state["task_state"])
        self._rollouts_drawn = int(state["rollouts_drawn"])

    def close(self) -> None:
        """Nothing to release: the toy engine is this process."""


def build(cfg: UnirlConfig, *, hf_model: Any = None, device: Any = None) -> ToyRolloutSource:
    return ToyRolloutSource(build_task(cfg), cfg)


PLUGIN = SourcePlugin(
    name="toy",
    options=ToySourceOptions,
    build=build,
    check=check,
    describe=describe,
    loggers=(LOGGER,),
    log_level_env=LOG_LEVEL_ENV,
)
