"""What `unirl check` validates about rollouts beyond the config's own types: the task and its
options build a task whose answers fit the generation budget, and the post-processing hook
imports with the right signature; with ``rollout.prompts``, the reward function imports and
binds its signature and options, and the prompt dataset (and ``eval.prompts``) is read and
checked row by row (lengths included; that it exists, `unirl.core.config.paths` checks first). `unirl train` meets
the same checks when it builds the rollout source, but a job should fail at ``check``, before
it is queued. A rollout file is not opened here: ``check`` plans a job, often on another
machine than the one holding finished rollouts."""

from __future__ import annotations

from unirl.core.config.run_config import UnirlConfig
from unirl.core.source_plugin import SOURCES
from unirl.rollouts.build import build_task, check_task_lengths
from unirl.rollouts.data.tasks import make_task
from unirl.rollouts.eval import build_eval_task
from unirl.rollouts.postprocess import load_postprocess_hook
from unirl.rollouts.rewards.registry import NamedReward, RewardRun


def check_rollout_config(cfg: UnirlConfig) -> None:
    r = cfg.rollout
    if r.prompts is not None:
        assert r.reward is not None  # the config checks it
        NamedReward(
            r.reward, r.reward_options, RewardRun.of(cfg)
        )  # imports it and binds the signature
        task = build_task(cfg)  # the dataset read and checked row by row
        if cfg.eval is not None:  # the held-out dataset too, with the rollouts' tokenizer
            build_eval_task(cfg, task.tokenizer)
    elif SOURCES.get(r.source).generates:  # a source of finished rollouts draws no task
        check_task_lengths(cfg, make_task(r.task, r.task_options))
    load_postprocess_hook(cfg)
