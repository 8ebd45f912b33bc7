"""Evaluation on held-out prompts during training (the ``eval`` section).

Every ``eval.every`` RL steps and after the last one, right after the weight sync (so the engine
holds the weights the step produced), every prompt of ``eval.prompts`` gets
``eval.samples_per_prompt`` responses from the rollout engine itself (the built-in sampler or
vLLM) at ``eval.temperature`` within ``eval.max_new_tokens``, scored by the rollout's reward (or
``eval.reward``); the run logs ``eval/reward_mean``, ``eval/pass@k`` (`unirl.rollouts.eval.metrics`)
and ``time/eval_s`` at that step, to metrics.jsonl, TensorBoard and W&B like every metric.

What it leaves alone. The eval draws from generators of its own, seeded by ``train.seed`` and the
step (the sampler: a `Sampler.variant` on the same model; vLLM: per-sample seeds), reads its own
prompt file and never hands a sample to the trainer: the training run, its rollouts and its
checkpoints are the same with and without it, and a resumed run evaluates what the uninterrupted
one did. It runs on global rank 0 (`unirl.rollouts.once`), in chunks of
``batch.prompts_per_rollout`` prompts (a rollout's size, which the engine already fits), and the
other ranks receive its metrics, waiting for them at most ``eval.timeout_s`` on a group of their
own (never in a training collective, whose ``parallel.timeout_s`` a long eval outlasts).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from unirl.core.config.run_config import UnirlConfig
from unirl.core.errors import ConfigError
from unirl.rollouts.data.hf_tokenizer import HFTokenizer
from unirl.rollouts.data.prompts import ColumnMap, PromptFileTask, read_prompt_records
from unirl.rollouts.eval.metrics import eval_metrics
from unirl.rollouts.once import on_rank0
from unirl.rollouts.rewards.registry import NamedReward, RewardRun

logger = logging.getLogger(__name__)


@runtime_checkable
class EvalEngine(Protocol):
    """A rollout source that can generate for an evaluation: ``task`` (whose tokenizer the
    eval prompts go through) and ``generate_eval`` (one response per prompt, from the current
    weights, with its own seeded randomness; called on global rank 0 only)."""

    task: Any

    def generate_eval(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_new_tokens: int,
        seed: int,
    ) -> list[tuple[list[int], bool]]: ...


def eval_seed(seed: int, step: int, chunk: int) -> int:
    """A 31-bit seed for chunk ``chunk`` of the evaluation at RL step ``step`` of a run seeded
    ``seed``, apart from every rollout seed."""
    digest = hashlib.blake2b(f"eval:{seed}:{step}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def build_eval_task(
    cfg: UnirlConfig, tokenizer: Any, train_reward: NamedReward | None = None
) -> PromptFileTask:
    """``eval.prompts`` read through the rollout's column mapping and chat template with the
    rollouts' ``tokenizer``, every row checked (its length against ``eval.max_new_tokens``),
    scored by ``eval.reward`` (or the rollout's: ``train_reward`` itself when given)."""
    e, r = cfg.eval, cfg.rollout
    assert e is not None
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(
            f"eval: the rollouts' tokenizer is {type(tokenizer).__name__}, not a prompt "
            "dataset's; train on rollout.prompts to evaluate"
        )
    spec = e.reward or r.reward
    assert spec is not None  # check_eval: eval.reward, or rollout.reward
    options = e.reward_options if e.reward is not None else r.reward_options
    same = train_reward is not None and (train_reward.spec, train_reward.options) == (spec, options)
    max_new_tokens = r.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens
    return PromptFileTask(
        e.prompts,
        tokenizer,
        train_reward if same and train_reward else NamedReward(spec, options, RewardRun.of(cfg)),
        seed=cfg.train.seed,
        max_prompt_length=cfg.model.max_seq_len - max_new_tokens,
        skip_long_prompts=r.skip_long_prompts,
        records=read_prompt_records(Path(e.prompts), ColumnMap.of(r)),
        apply_chat_template=r.apply_chat_template,
        system_prompt=r.system_prompt,
    )


class Evaluator:
    """The ``eval`` section over a built source (see the module docstring)."""

    def __init__(self, cfg: UnirlConfig, source: Any) -> None:
        e, r = cfg.eval, cfg.rollout
        assert e is not None  # build_evaluator's caller
        if not isinstance(source, EvalEngine):
            raise ConfigError(
                f"eval: rollout.source: {r.source} cannot generate for an evaluation (its source "
                f"{type(source).__name__} has no generate_eval); remove eval or use the sampler "
                "or vllm source"
            )
        self.source, self.cfg = source, cfg
        self.every, self.samples = e.every, e.samples_per_prompt
        self.temperature = r.temperature if e.temperature is None else e.temperature
        self.max_new_tokens = r.max_new_tokens if e.max_new_tokens is None else e.max_new_tokens
        self.threshold, self.timeout_s = e.pass_threshold, e.timeout_s
        self.chunk = cfg.batch.prompts_per_rollout
        train_reward = source.task.reward_fn if isinstance(source.task, PromptFileTask) else None
        self.task = build_eval_task(cfg, source.task.tokenizer, train_reward)
        self._own_reward = self.task.reward_fn is not train_reward

    def due(self, step: int, total: int) -> bool:
        """Whether the eval runs after RL step ``step`` (1-based) of ``total``."""
        return step == total or (self.every > 0 and step % self.every == 0)

    def run(self, step: int) -> dict[str, float]:
        """The ``eval/*`` metrics after RL step ``step`` (on every rank; computed on rank 0)."""
        return on_rank0(
            lambda: self._evaluate(step),
            f"the evaluation after RL step {step}",
            timeout_s=self.timeout_s,
            key="eval.timeout_s",
            advice="raise it, or evaluate less (fewer eval.prompts, eval.samples_per_prompt or "
            "eval.max_new_tokens)",
        )

    def _evaluate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        problems = self.task.problems
        n = self.samples
        responses: list[list[int]] = []
        for c, first in enumerate(range(0, len(problems), self.chunk)):
            prompts = [
                p.prompt_tokens for p in problems[first : first + self.chunk] for _ in range(n)
            ]
            generated = self.source.generate_eval(
                prompts,
                temperature=self.temperature,
                max_new_tokens=self.max_new_tokens,
                seed=eval_seed(self.cfg.train.seed, step, c),
            )
            responses += [list(ids) for ids, _ in generated]
        sample_problems = [p for p in problems for _ in range(n)]
        rewards = self.task.rewards(sample_problems, responses)
        metrics = eval_metrics(
            rewards,
            [len(r) for r in responses],
            samples_per_prompt=n,
            threshold=self.threshold,
        )
        metrics["time/eval_s"] = time.perf_counter() - t0
        logger.info(
            "eval after RL step %d: reward %.4f, pass@%d %.4f (%d prompts x %d samples, %.1f s)",
            step, metrics["eval/reward_mean"], n, metrics[f"eval/pass@{n}"], len(problems), n,
            metrics["time/eval_s"],
        )  # fmt: skip
        return metrics

    def close(self) -> None:
        """Stop the eval reward's workers (when it is not the rollouts' own reward)."""
        if self._own_reward:
            self.task.close()


def build_evaluator(cfg: UnirlConfig, source: Any) -> Evaluator | None:
    """The run's evaluator over ``source``; None without an ``eval`` section."""
    return None if cfg.eval is None else Evaluator(cfg, source)
