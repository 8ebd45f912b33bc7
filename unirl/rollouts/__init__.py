"""Rollout sources: built-in tasks with verifiable rewards, their tokenizer, a sampler, and a
reader for rollout files from other engines.

    from unirl.rollouts import build_rollout_source

    source = build_rollout_source(cfg, hf_model=policy)   # rollout.source: sampler | file
    for step in range(cfg.train.rl_steps):
        batch = source.next_rollout(step)
        ...                                               # train on the batch
        source.sync_weights(policy_state_dict)            # the next rollout is on-policy

Tasks: ``reverse_digits`` and ``add_small`` (`unirl.rollouts.tasks`); add one with
`register_task`. Importing this package needs no transformers; building a model does.
"""

from unirl.rollouts.build import build_rollout_source, check_task_lengths, write_task_rollouts
from unirl.rollouts.model import build_task_model, hf_config_for_tokenizer
from unirl.rollouts.sampler import Generation, Sampler, top_p_filter
from unirl.rollouts.sampler_source import SamplerRolloutSource, model_vocab_size
from unirl.rollouts.source import FileRolloutSource, RolloutSource
from unirl.rollouts.tasks import (
    AddSmall,
    Problem,
    ReverseDigits,
    Task,
    make_task,
    positional_reward,
    register_task,
    registered_tasks,
)
from unirl.rollouts.tokenizer import CharTokenizer

__all__ = [
    "AddSmall",
    "CharTokenizer",
    "FileRolloutSource",
    "Generation",
    "Problem",
    "ReverseDigits",
    "RolloutSource",
    "Sampler",
    "SamplerRolloutSource",
    "Task",
    "build_rollout_source",
    "build_task_model",
    "check_task_lengths",
    "hf_config_for_tokenizer",
    "make_task",
    "model_vocab_size",
    "positional_reward",
    "register_task",
    "registered_tasks",
    "top_p_filter",
    "write_task_rollouts",
]
