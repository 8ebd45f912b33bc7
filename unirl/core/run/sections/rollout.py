"""The ``rollout`` section: how rollouts are produced or read, and its ``vllm`` engine options."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from unirl.core.run.validators import (
    in_range,
    positive,
)


@attrs.frozen(kw_only=True)
class VllmConfig:
    """Engine options of ``rollout.source: vllm`` (`unirl.rollouts.vllm`); the defaults run the
    tiny examples on a laptop CPU. Sampling settings (temperature, top_p, max_new_tokens) and the
    seed come from ``rollout`` and ``train.seed``, so the sampler and the engine share them."""

    # The engine's weights dtype; "model" = model.dtype (fp32 gives log-probs that match the
    # trainer's to ~1e-6; bf16 engines differ from an fp32 trainer by ~1e-2).
    dtype: Literal["model", "fp32", "bf16"] = "model"
    # KV-cache size in GiB (vLLM's kv_cache_memory_bytes; on a GPU it replaces
    # gpu_memory_utilization): the engine holds this many tokens' keys and values at once.
    kv_cache_gb: float = attrs.field(default=0.25, validator=positive)
    # No torch.compile / CUDA graphs: starts in seconds; set false on a GPU for speed.
    enforce_eager: bool = True
    # The longest prompt + response the engine accepts; null = model.max_seq_len.
    max_model_len: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    tensor_parallel_size: int = attrs.field(default=1, validator=positive)
    # Where weight syncs are written for the engine to reload (a tmpfs folder: memory, not
    # disk); null = a fresh folder under /dev/shm when it exists, else the system temp folder.
    sync_dir: str | None = None


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """How rollouts are produced or read. The temperature is also the one the trainer divides
    logits by, so train and rollout log-probs describe the same distribution."""

    source: Literal["sampler", "file", "vllm"] = "sampler"
    file: str | None = None
    task: str = "reverse_digits"
    # Keyword arguments of the task's factory, e.g. {min_digits: 2, max_digits: 3}.
    task_options: dict[str, Any] = attrs.field(factory=dict)
    temperature: float = attrs.field(default=1.0, validator=positive)
    top_p: float = attrs.field(default=1.0, validator=in_range(0, 1, low_open=True))
    max_new_tokens: int = attrs.field(default=64, validator=positive)
    vllm: VllmConfig = attrs.field(factory=VllmConfig)
    # A JSONL prompt file used instead of rollout.task, scored by rollout.reward (a registered
    # name or "package.module:function") with rollout.reward_options as keyword arguments
    # (unirl/rollouts/prompts.py, unirl/rollouts/rewards.py).
    prompts: str | None = None
    reward: str | None = None
    reward_options: dict[str, Any] = attrs.field(factory=dict)
    # Drop prompts longer than model.max_seq_len - max_new_tokens (with a warning) instead of
    # refusing the file.
    skip_long_prompts: bool = False
