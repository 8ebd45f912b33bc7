"""What `unirl check` validates about rollouts beyond the config's own types: the task and its
options build a task whose answers fit the generation budget, and the post-processing hook
imports with the right signature; with ``rollout.prompts``, the reward function imports and
binds its signature and options, and the prompt dataset (and ``eval.prompts``) is read and
checked row by row (lengths included, and the reference answer a built-in reward reads; that it
exists, `unirl.core.config.paths` checks first); ``rollout.environment`` builds. `unirl train` meets
the same checks when it builds the rollout source, but a job should fail at ``check``, before
it is queued. A rollout file is not opened here: ``check`` plans a job, often on another
machine than the one holding finished rollouts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unirl.core.config.run_config import UnirlConfig
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES
from unirl.rollouts.build import build_task, check_task_lengths
from unirl.rollouts.data.prompts import PromptFileTask
from unirl.rollouts.data.tasks import make_task
from unirl.rollouts.environments.registry import environment_factory
from unirl.rollouts.eval.evaluator import build_eval_task
from unirl.rollouts.postprocess import load_postprocess_hook
from unirl.rollouts.rewards.math import REFERENCE_READERS
from unirl.rollouts.rewards.registry import NamedReward, RewardRun


def check_references(task: PromptFileTask, spec: str, options: Mapping[str, Any], key: str) -> None:
    """Every prompt of ``task`` holds the reference a built-in reward ``spec`` reads (its
    ``answer_key`` option, else "answer"); ``key`` names the setting that chose ``spec``. A
    user's reward reads what it likes: not checked."""
    read = REFERENCE_READERS.get(spec)
    if read is None:
        return
    answer_key = str(options.get("answer_key", "answer"))
    for i, problem in enumerate(task.problems):
        try:
            read(problem.metadata, answer_key)
        except ValueError as exc:
            raise ConfigError(f"{key}={spec!r}, {task.path} prompt {i}: {exc}") from None


def check_rollout_config(cfg: UnirlConfig) -> None:
    r = cfg.rollout
    if r.prompts is not None:
        assert r.reward is not None  # the config checks it
        NamedReward(
            r.reward, r.reward_options, RewardRun.of(cfg)
        )  # imports it and binds the signature
        task = build_task(cfg)  # the dataset read and checked row by row
        assert isinstance(task, PromptFileTask)
        check_references(task, r.reward, r.reward_options, "rollout.reward")
        if cfg.eval is not None:  # the held-out dataset too, with the rollouts' tokenizer
            held_out = build_eval_task(cfg, task.tokenizer)
            own = cfg.eval.reward is not None
            check_references(
                held_out,
                cfg.eval.reward if own else r.reward,  # type: ignore[arg-type]
                cfg.eval.reward_options if own else r.reward_options,
                "eval.reward" if own else "rollout.reward",
            )
    elif SOURCES.get(r.source).generates:  # a source of finished rollouts draws no task
        check_task_lengths(cfg, make_task(r.task, r.task_options))
    if r.environment is not None:  # imported (or looked up) and one instance built
        environment_factory(r.environment, r.environment_options)
    load_postprocess_hook(cfg)


def rank0_waits_note(cfg: UnirlConfig) -> str:
    """What `unirl check` says about the other ranks' waits for the work rank 0 does once
    (`unirl.rollouts.once`): each bounded by the work's own timeout, never parallel.timeout_s."""
    r, a = cfg.rollout, cfg.algorithm
    bound = RewardRun.of(cfg).wait_bound(cfg.layout.rollout_samples) if r.prompts else None
    rewards = (
        f"the rewards at most {bound[1]}"
        if bound is not None
        else "the rewards as long as rank 0 scores (in the training process, which nothing "
        "there stops; rollout.reward_workers with rollout.reward_timeout_s bounds them)"
    )
    if r.source != "sampler":  # vLLM, the agents: scored with the rollout, within its wait
        rewards = "the rewards within the rollout's own wait (scored with it on rank 0)"
    parts = [rewards] if SOURCES.get(r.source).generates else []
    if a.rollout_postprocess_hook is not None:
        limit = a.rollout_postprocess_timeout_s
        parts.append(
            "the hook as long as it runs (algorithm.rollout_postprocess_timeout_s: null)"
            if limit is None
            else f"the hook at most algorithm.rollout_postprocess_timeout_s={limit:g} s"
        )
    if cfg.eval is not None:
        parts.append(f"the evaluation at most eval.timeout_s={cfg.eval.timeout_s:g} s")
    if not parts:
        return "nothing: rank 0 runs no work once for the others"
    return (
        "with several ranks, rank 0 runs each once and the others wait on a group of their "
        "own: " + "; ".join(parts)
    )
