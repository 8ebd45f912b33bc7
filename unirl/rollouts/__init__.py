"""Rollout sources, as plug-ins: built-in tasks with verifiable rewards, their tokenizer, a
sampler, a reader for rollout files from other engines, and vLLM.

    from unirl.rollouts import build_rollout_source

    source = build_rollout_source(cfg, hf_model=policy)   # the plug-in rollout.source names
    for step in range(cfg.train.rl_steps):
        batch = source.next_rollout(step)
        ...                                               # train on the batch
        source.sync_weights(policy_state_dict, policy_version=n)  # the next rollout is on-policy

Importing this package registers the built-in sources (``sampler``, ``file``, ``vllm``, ``agent``) in
`unirl.core.protocols.source_plugin.SOURCES` from their light ``plugins`` modules, and the rules of the
rollout-owned config keys in `unirl.core.config.rules.CONFIG_RULES`, and imports nothing else: the names below load on first use (so ``import unirl`` stays free of torch). What a new
source provides, file by file: ``unirl/rollouts/README.md``.

Tasks: ``reverse_digits`` and ``add_small`` (`unirl.rollouts.data.tasks`); add one with
`register_task`. Or prompts from a JSONL file (``rollout.prompts``, `unirl.rollouts.data.prompts`)
scored by a reward function chosen by name (``rollout.reward``, `unirl.rollouts.rewards.registry`); a
generating source gets either through `build_task` and scores a rollout with `task_rewards`.
Importing this package needs no transformers; building a model or a tokenizer does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.config.rules import CONFIG_RULES
from unirl.core.imports import lazy_attributes
from unirl.core.protocols.source_plugin import SOURCES
from unirl.rollouts.data.rules import check_prompts, check_stops
from unirl.rollouts.environments.rules import check_environment
from unirl.rollouts.eval.rules import check_eval
from unirl.rollouts.gateway.plugin import PLUGIN as AGENT
from unirl.rollouts.plugins import FILE, SAMPLER
from unirl.rollouts.shaping.settings import check_dynamic_sampling
from unirl.rollouts.vllm.plugin import PLUGIN as VLLM

for _plugin in (SAMPLER, FILE, VLLM, AGENT):
    SOURCES.register(_plugin.name, _plugin)

# The rules of the rollout-owned keys, run when a config is built, in this order.
for _key, _rule in (
    ("rollout.prompts", check_prompts),
    ("rollout.stop", check_stops),
    ("rollout.environment", check_environment),
    ("eval", check_eval),
    ("rollout.dynamic_sampling", check_dynamic_sampling),
):
    CONFIG_RULES.register(_key, _rule)

if TYPE_CHECKING:
    from unirl.rollouts.build import (
        build_rollout_source,
        build_task,
        check_task_lengths,
        run_tokenizer,
        save_run_tokenizer,
        write_task_rollouts,
    )
    from unirl.rollouts.data.tasks import (
        AddSmall,
        BatchRewardTask,
        Problem,
        ReverseDigits,
        StatefulTask,
        Task,
        TaskTokenizer,
        load_task_state,
        make_task,
        positional_reward,
        register_task,
        registered_tasks,
        task_rewards,
        task_state,
    )
    from unirl.rollouts.data.tokenizer import CharTokenizer
    from unirl.rollouts.model import build_task_model, hf_config_for_tokenizer
    from unirl.rollouts.rewards.registry import register_reward, registered_rewards
    from unirl.rollouts.sampler import Generation, Sampler, top_p_filter
    from unirl.rollouts.sampler_source import SamplerRolloutSource, model_vocab_size
    from unirl.rollouts.source import FileRolloutSource, RolloutSource

# Public name -> the module that defines it (imported on first access, PEP 562).
_LAZY = {
    "AddSmall": "unirl.rollouts.data.tasks",
    "BatchRewardTask": "unirl.rollouts.data.tasks",
    "CharTokenizer": "unirl.rollouts.data.tokenizer",
    "FileRolloutSource": "unirl.rollouts.source",
    "Generation": "unirl.rollouts.sampler",
    "Problem": "unirl.rollouts.data.tasks",
    "ReverseDigits": "unirl.rollouts.data.tasks",
    "RolloutSource": "unirl.rollouts.source",
    "Sampler": "unirl.rollouts.sampler",
    "SamplerRolloutSource": "unirl.rollouts.sampler_source",
    "StatefulTask": "unirl.rollouts.data.tasks",
    "Task": "unirl.rollouts.data.tasks",
    "TaskTokenizer": "unirl.rollouts.data.tasks",
    "build_rollout_source": "unirl.rollouts.build",
    "build_task": "unirl.rollouts.build",
    "build_task_model": "unirl.rollouts.model",
    "check_task_lengths": "unirl.rollouts.build",
    "hf_config_for_tokenizer": "unirl.rollouts.model",
    "load_task_state": "unirl.rollouts.data.tasks",
    "make_task": "unirl.rollouts.data.tasks",
    "model_vocab_size": "unirl.rollouts.sampler_source",
    "positional_reward": "unirl.rollouts.data.tasks",
    "register_reward": "unirl.rollouts.rewards.registry",
    "register_task": "unirl.rollouts.data.tasks",
    "registered_rewards": "unirl.rollouts.rewards.registry",
    "registered_tasks": "unirl.rollouts.data.tasks",
    "run_tokenizer": "unirl.rollouts.build",
    "save_run_tokenizer": "unirl.rollouts.build",
    "task_rewards": "unirl.rollouts.data.tasks",
    "task_state": "unirl.rollouts.data.tasks",
    "top_p_filter": "unirl.rollouts.sampler",
    "write_task_rollouts": "unirl.rollouts.build",
}


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)


__all__ = [
    "AddSmall",
    "BatchRewardTask",
    "CharTokenizer",
    "FileRolloutSource",
    "Generation",
    "Problem",
    "ReverseDigits",
    "RolloutSource",
    "Sampler",
    "SamplerRolloutSource",
    "StatefulTask",
    "Task",
    "TaskTokenizer",
    "build_rollout_source",
    "build_task",
    "build_task_model",
    "check_task_lengths",
    "hf_config_for_tokenizer",
    "load_task_state",
    "make_task",
    "model_vocab_size",
    "positional_reward",
    "register_reward",
    "register_task",
    "registered_rewards",
    "registered_tasks",
    "run_tokenizer",
    "save_run_tokenizer",
    "task_rewards",
    "task_state",
    "top_p_filter",
    "write_task_rollouts",
]
