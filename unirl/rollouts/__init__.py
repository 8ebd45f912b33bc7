"""Rollout sources: built-in tasks with verifiable rewards, their tokenizer, a sampler, and a
reader for rollout files from other engines.

    from unirl.rollouts import build_rollout_source

    source = build_rollout_source(cfg, hf_model=policy)   # rollout.source: sampler | file
    for step in range(cfg.train.rl_steps):
        batch = source.next_rollout(step)
        ...                                               # train on the batch
        source.sync_weights(policy_state_dict)            # the next rollout is on-policy

Tasks: ``reverse_digits`` and ``add_small`` (`unirl.rollouts.tasks`); add one with
`register_task`. Or prompts from a JSONL file (``rollout.prompts``, `unirl.rollouts.prompts`)
scored by a reward function chosen by name (``rollout.reward``, `unirl.rollouts.rewards`); a
generating source gets either through `build_task` and scores a rollout with `task_rewards`.
Importing this package needs no transformers; building a model or a tokenizer does.
"""

from unirl.rollouts.build import (
    build_rollout_source,
    build_task,
    check_task_lengths,
    run_tokenizer,
    save_run_tokenizer,
    write_task_rollouts,
)
from unirl.rollouts.model import build_task_model, hf_config_for_tokenizer
from unirl.rollouts.rewards import register_reward, registered_rewards
from unirl.rollouts.sampler import Generation, Sampler, top_p_filter
from unirl.rollouts.sampler_source import SamplerRolloutSource, model_vocab_size
from unirl.rollouts.source import FileRolloutSource, RolloutSource
from unirl.rollouts.tasks import (
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
from unirl.rollouts.tokenizer import CharTokenizer

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
