"""The rollout source a config asks for, and rollout files written from a built-in task.

source = build_rollout_source(cfg, hf_model=policy_hf_model)  # the plug-in rollout.source names
write_task_rollouts("rollouts.jsonl", cfg, n_rollouts=4, seed=0)
save_run_tokenizer(cfg, "runs/x/hf")   # the tokenizer the rollouts used, beside the weights
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from unirl.core.config.run_config import UnirlConfig
from unirl.core.data.rollout import RolloutSample
from unirl.core.data.rollout_io import write_rollouts
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES, build_source
from unirl.rollouts.data.tasks import Task, make_task
from unirl.rollouts.data.tokenizer import CharTokenizer
from unirl.rollouts.model import build_task_model
from unirl.rollouts.sampler_source import SamplerRolloutSource
from unirl.rollouts.shaping.settings import RolloutShaping
from unirl.rollouts.source import FileRolloutSource, RolloutSource


def check_task_lengths(cfg: UnirlConfig, task: Task) -> None:
    """Every answer must fit the generation budget, and prompt + budget the sequence length."""
    budget, max_seq_len = cfg.rollout.max_new_tokens, cfg.model.max_seq_len
    if budget < task.max_target_length:
        raise ConfigError(
            f"rollout.max_new_tokens={budget} is shorter than the longest answer of task "
            f"{task.name!r} ({task.max_target_length} tokens with <eos>), so some prompts could "
            f"never earn reward 1; set it to {task.max_target_length} or more"
        )
    if task.max_prompt_length + budget > max_seq_len:
        raise ConfigError(
            f"task {task.name!r} prompts of up to {task.max_prompt_length} tokens plus "
            f"rollout.max_new_tokens={budget} exceed model.max_seq_len={max_seq_len}; raise "
            f"model.max_seq_len to {task.max_prompt_length + budget} or lower the budget"
        )


def build_task(cfg: UnirlConfig) -> Task:
    """The task a generating source draws from: the prompt file of ``rollout.prompts`` scored by
    ``rollout.reward``, else the task ``rollout.task`` names; its lengths checked."""
    if cfg.rollout.prompts is not None:
        from unirl.rollouts.data.prompts import make_prompt_task  # tokenizers need transformers

        task: Task = make_prompt_task(cfg)
    else:
        task = make_task(cfg.rollout.task, cfg.rollout.task_options)
    check_task_lengths(cfg, task)
    return task


def _sampler_source(
    cfg: UnirlConfig,
    hf_model: torch.nn.Module | None,
    device: torch.device | str | None,
    seed: int,
) -> SamplerRolloutSource:
    task = build_task(cfg)
    if hf_model is None:
        hf_model = build_task_model(cfg.model, task.tokenizer)
    return SamplerRolloutSource(
        task,
        hf_model,
        prompts_per_rollout=cfg.batch.prompts_per_rollout,
        samples_per_prompt=cfg.batch.samples_per_prompt,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=seed,
        verify_sync=cfg.rollout.verify_sync,
        device=device,
        stop=cfg.rollout.stop,
        stop_token_ids=cfg.rollout.stop_token_ids,
        shaping=RolloutShaping.from_config(cfg),
        lora=cfg.model.lora,
        **episode_options(cfg),
    )


def episode_options(cfg: UnirlConfig) -> dict[str, Any]:
    """A source's multi-turn arguments (none without ``rollout.environment``): the
    environment builder, the episode limits and the longest prompt + response."""
    r = cfg.rollout
    if r.environment is None:
        return {}
    from unirl.rollouts.environments.episodes import EpisodeLimits
    from unirl.rollouts.environments.registry import environment_factory

    return {
        "environment": environment_factory(r.environment, r.environment_options),
        "episode_limits": EpisodeLimits(
            max_turns=r.max_turns,
            max_tokens=r.max_episode_tokens or cfg.model.max_seq_len,
            step_timeout_s=r.env_step_timeout_s,
            failure_reward=r.env_failure_reward,
        ),
        "max_seq_len": cfg.model.max_seq_len,
    }


def build_sampler_source(
    cfg: UnirlConfig,
    *,
    hf_model: torch.nn.Module | None = None,
    device: torch.device | str | None = None,
) -> SamplerRolloutSource:
    """The ``sampler`` plug-in's constructor: ``rollout.task`` (or ``rollout.prompts``) sampled
    with a copy of ``hf_model`` (built from ``cfg.model`` when None), seeded by ``train.seed``."""
    return _sampler_source(cfg, hf_model, device, cfg.train.seed)


def build_file_source(
    cfg: UnirlConfig, *, hf_model: Any = None, device: Any = None
) -> FileRolloutSource:
    """The ``file`` plug-in's constructor: ``rollout.file`` cut into rollouts of the batch's
    size (no model: the file's samples are finished)."""
    assert cfg.rollout.file is not None  # the plug-in's check makes sure
    return FileRolloutSource(cfg.rollout.file, rollout_size=cfg.layout.rollout_samples)


def build_rollout_source(
    cfg: UnirlConfig,
    *,
    hf_model: torch.nn.Module | None = None,
    device: torch.device | str | None = None,
) -> RolloutSource:
    """The source ``rollout.source`` names, built by its plug-in (`unirl.core.protocols.source_plugin`):
    ``file`` reads ``rollout.file``; ``vllm`` generates with a vLLM engine
    (`unirl.rollouts.vllm`, started at the first ``sync_weights``); ``sampler`` samples
    ``rollout.task`` with a copy of ``hf_model`` (the policy in Hugging Face form; built from
    ``cfg.model`` when None), on ``device`` (default: the model's), seeded by ``train.seed``.
    Call ``sync_weights`` with the policy's weights before the first rollout when ``hf_model``
    is not the policy's init."""
    source: RolloutSource = build_source(cfg, hf_model=hf_model, device=device)
    return source


def write_task_rollouts(
    path: str | os.PathLike[str],
    cfg: UnirlConfig,
    n_rollouts: int,
    seed: int,
    *,
    hf_model: torch.nn.Module | None = None,
) -> int:
    """Sample ``n_rollouts`` rollouts of ``rollout.task`` with a freshly initialised model from
    ``cfg.model`` (or ``hf_model``) and write them as JSONL (with rollout log-probs), whatever
    ``rollout.source`` says. Returns the number of samples written."""
    samples = sample_task_rollouts(cfg, n_rollouts, seed, hf_model=hf_model)
    write_rollouts(path, samples)
    return len(samples)


def sample_task_rollouts(
    cfg: UnirlConfig, n_rollouts: int, seed: int, *, hf_model: torch.nn.Module | None = None
) -> list[RolloutSample]:
    """The samples `write_task_rollouts` writes."""
    if n_rollouts < 1:
        raise ConfigError(f"write_task_rollouts: n_rollouts must be >= 1, got {n_rollouts}")
    source = _sampler_source(cfg, hf_model, None, seed)
    return [s for step in range(n_rollouts) for s in source.next_rollout(step).samples]


def run_tokenizer(cfg: UnirlConfig) -> Any | None:
    """The Hugging Face tokenizer of the run's rollouts: that of ``rollout.prompts`` (see
    `unirl.rollouts.data.prompts.prompt_tokenizer`), the built-in task's character tokenizer, or
    None for a source that does not generate, e.g. a rollout file (the export then carries ``model.path``'s tokenizer files, if any)."""
    if not SOURCES.get(cfg.rollout.source).generates:
        return None
    from unirl.rollouts.data.hf_tokenizer import char_tokenizer_to_hf

    if cfg.rollout.prompts is not None:
        from unirl.rollouts.data.prompts import prompt_records, prompt_tokenizer

        needs_file = cfg.model.tokenizer is None and cfg.model.path is None
        records = prompt_records(cfg) if needs_file else []
        return prompt_tokenizer(cfg, records).hf
    task = make_task(cfg.rollout.task, cfg.rollout.task_options)
    if not isinstance(task.tokenizer, CharTokenizer):
        return None  # a custom task with its own tokenizer: nothing unirl knows how to save
    return char_tokenizer_to_hf(task.tokenizer)


def save_run_tokenizer(cfg: UnirlConfig, folder: str | os.PathLike[str]) -> bool:
    """Save `run_tokenizer` into ``folder`` (the Hugging Face export), so that
    ``AutoTokenizer.from_pretrained(folder)`` (and a serving engine) gets the ids the policy was
    trained on. A tokenizer already there (copied from ``model.path``) is kept unless
    ``model.tokenizer`` names another. Returns whether one was written."""
    from unirl.rollouts.data.hf_tokenizer import save_hf_tokenizer

    folder = Path(folder)
    if cfg.model.tokenizer is None and (folder / "tokenizer_config.json").is_file():
        return False
    tokenizer = run_tokenizer(cfg)
    if tokenizer is None:
        return False
    save_hf_tokenizer(tokenizer, folder)
    return True
