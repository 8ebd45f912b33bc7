"""The run configuration: frozen attrs classes loaded from YAML, validated once, with derived values.

A config is plain data with its defaults on the schema only. `load_config` reads YAML (safe loader),
applies ``--set key.path=value`` overrides, converts to the classes below and checks every
combination; each mistake raises `ConfigError` naming the key path, the value seen and what would be
valid. Derived values (data-parallel size, optimizer steps per rollout, microbatches per step) are
computed once, in `Layout`.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from unirl.core.backend_plugin import BACKENDS
from unirl.core.data.plan import split_per_rank
from unirl.core.errors import ConfigError
from unirl.core.run.validators import (
    adam_betas,
    check_hf_config_shape,
    in_range,
    non_negative,
    positive,
    unit_interval,
)
from unirl.core.topology import data_parallel_size, expert_data_parallel_size

OldLogprobMode = Literal["auto", "recompute", "reuse", "rollout"]
Dtype = Literal["fp32", "bf16"]
Schedule = Literal["constant", "linear", "cosine"]


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The policy model: a local Hugging Face folder, or a HF config dict with a seed (random init)."""

    path: str | None = None
    hf_config: dict[str, Any] | None = attrs.field(default=None, validator=check_hf_config_shape)
    init_seed: int = 0
    dtype: Dtype = "fp32"
    gradient_checkpointing: bool = False
    # Log-probs straight from the final hidden states and the LM head's weight, in vocabulary
    # chunks (`unirl.core.maths.logprobs_hidden`): the [tokens, vocab] logits and their gradient
    # are never held (4.6 GiB each in bf16 at 16k tokens x 152k vocabulary), for one more
    # head-sized matmul in backward. Off by default: measured slower on the CPU (head +
    # log-probs 1.25x, in-process A/B, benchmarks/fused_head.py); turn it on when the logits cap
    # the microbatch length.
    fused_head: bool = False
    max_seq_len: int = attrs.field(default=2048, validator=positive)
    # A local Hugging Face tokenizer folder for rollout.prompts text (and saved with the export);
    # None: model.path's tokenizer, else a character tokenizer over the prompt file.
    tokenizer: str | None = None
    # The reference model for KL; defaults to the initial policy weights.
    ref_path: str | None = None
    ref_offload: bool = False


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """AdamW on every backend (torch's; Megatron's wraps it in its distributed optimizer)."""

    # Above 1e30 AdamW's first step size, lr / (1 - betas[0]), nears fp32's limit and torch fails.
    lr: float = attrs.field(
        default=1e-6,
        validator=in_range(0, 1e30, low_open=True, why="typical RL values: 1e-7 to 1e-5"),
    )
    # AdamW's decoupled decay, on matrices only: norms and biases (1-D parameters) are not
    # decayed, as in Megatron-core and the Hugging Face Trainer (every backend does the same).
    weight_decay: float = attrs.field(default=0.0, validator=non_negative)
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), validator=adam_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    # The max global grad norm; null = no clipping (0 or less is refused: it is not "off").
    grad_clip: float | None = attrs.field(default=1.0, validator=positive)
    lr_schedule: Schedule = "constant"
    warmup_steps: int = attrs.field(default=0, validator=non_negative)
    min_lr_ratio: float = attrs.field(default=0.0, validator=unit_interval)


@attrs.frozen(kw_only=True)
class BatchConfig:
    """Sizes of one RL step. A rollout is ``prompts_per_rollout x samples_per_prompt`` samples,
    cut into optimizer steps of ``samples_per_optimizer_step``, each into microbatches by count
    (``micro_batch_size`` samples per rank) or by a token budget (``max_tokens_per_microbatch``)."""

    prompts_per_rollout: int = attrs.field(default=8, validator=positive)
    samples_per_prompt: int = attrs.field(default=4, validator=positive)
    samples_per_optimizer_step: int = attrs.field(default=32, validator=positive)
    micro_batch_size: int | None = attrs.field(default=None, validator=positive)
    max_tokens_per_microbatch: int | None = attrs.field(default=None, validator=positive)
    epochs_per_rollout: int = attrs.field(default=1, validator=positive)


@attrs.frozen(kw_only=True)
class ParallelConfig:
    tp: int = attrs.field(default=1, validator=positive)
    pp: int = attrs.field(default=1, validator=positive)
    vpp: int | None = attrs.field(default=None, validator=positive)
    cp: int = attrs.field(default=1, validator=positive)
    # Mixture-of-experts layers (Megatron): experts split over ``ep`` ranks, each expert's
    # weights over ``etp`` ranks (None: tp, megatron-core's default); etp x ep x pp divides the
    # world, and the rest is the expert data-parallel size (unirl.core.topology).
    ep: int = attrs.field(default=1, validator=positive)
    etp: int | None = attrs.field(default=None, validator=positive)
    zero_stage: Literal[0, 1, 2, 3] = 0
    # None: read WORLD_SIZE from the environment (1 without a launcher).
    world_size: int | None = attrs.field(default=None, validator=positive)
    # How long a collective (and so every rank) waits for a rank that stopped answering before
    # the run fails on every rank; None: 300 s on the CPU (gloo), 1800 s on GPUs (NCCL, whose
    # first collectives and large checkpoint saves can take minutes).
    timeout_s: float | None = attrs.field(default=None, validator=positive)


# The algorithm sections hold plain values: their names and bounds are checked once, by the
# loss and advantage settings they are turned into (`unirl.core.run.algorithm`).


@attrs.frozen(kw_only=True)
class KLConfig:
    coef: float = 0.0
    estimator: str = "low_var_kl"  # a name of `unirl.core.maths.kl.KL_ESTIMATORS`


@attrs.frozen(kw_only=True)
class RolloutCorrectionConfig:
    """Correction for the rollout engine's log-probs differing from the trainer's (TIS, IcePop)."""

    mode: str = "none"  # one of `unirl.core.maths.losses.ROLLOUT_CORRECTION_MODES`
    low: float = 0.5
    high: float = 2.0


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    policy_loss: str = "ppo_clip"
    advantage_estimator: str = "grpo"
    loss_aggregation: str = "token-mean"  # one of `unirl.core.maths.losses.AGGREGATION_MODES`
    # Dr.GRPO's constant for seq-mean-token-sum-norm; defaults to rollout.max_new_tokens.
    norm_length: int | None = attrs.field(default=None, validator=positive)
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    kl_loss: KLConfig = attrs.field(factory=KLConfig)
    kl_in_reward: KLConfig = attrs.field(factory=lambda: KLConfig(estimator="k1"))
    rollout_correction: RolloutCorrectionConfig = attrs.field(factory=RolloutCorrectionConfig)
    gamma: float = 1.0
    lam: float = 1.0
    std_normalize: bool = True
    whiten_advantages: bool = False
    value_coef: float = 0.5
    value_clip: float | None = 0.2
    # On-policy distillation shaping: A -= coef * (logp_student - logp_teacher).
    distillation_coef: float = 0.0
    # Features that read the policy's log-probs before the first optimizer step.
    mismatch_metrics: bool = False
    # "package.module:function" called as hook(batch, *, rl_step) -> RolloutBatch on every
    # rollout before it is trained on (user code, like any plug-in; unirl/rollouts/postprocess.py).
    rollout_postprocess_hook: str | None = None


@attrs.frozen(kw_only=True)
class CriticConfig:
    """PPO's learned value function: a causal-LM backbone with a scalar head per token, trained in
    the same run beside the policy with its own optimizer and LR schedule; GAE reads its values
    (`unirl.core.critic`). The loss is the shared clipped value loss (``algorithm.value_clip``,
    weighted by ``algorithm.value_coef``)."""

    # None: on exactly when algorithm.advantage_estimator uses values (gae). false with gae takes
    # the values from the rollout (a file's per-token 'values').
    enabled: bool | None = None
    # A local Hugging Face folder: a causal LM (its backbone is taken, the head initialised) or a
    # saved critic (a run's hf_critic/). None: the policy's initial weights (model.path or
    # model.hf_config + model.init_seed), with the head initialised from model.init_seed.
    path: str | None = None
    optimizer: OptimizerConfig = attrs.field(factory=lambda: OptimizerConfig(lr=1e-5))
    # Samples per critic microbatch per rank; None: the policy's plan (batch.micro_batch_size or
    # batch.max_tokens_per_microbatch).
    micro_batch_size: int | None = attrs.field(default=None, validator=positive)
    # The critic's own ZeRO stage (DeepSpeed) / distributed optimizer (Megatron, 1); None: the
    # policy's parallel.zero_stage.
    zero_stage: Literal[0, 1, 2, 3] | None = None
    # RL steps at the start of the run that train only the critic (the policy waits for values
    # that mean something; its LR schedule counts only the steps it takes).
    warmup_steps: int = attrs.field(default=0, validator=non_negative)


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


@attrs.frozen(kw_only=True)
class TrainConfig:
    rl_steps: int = attrs.field(default=10, validator=positive)
    seed: int = 0
    # Stop the run (non-zero exit) after this many optimizer steps in a row were skipped for a
    # non-finite loss or gradient; 0 = never stop for that (non-finite weights always stop it).
    max_consecutive_skipped_steps: int = attrs.field(default=3, validator=non_negative)


@attrs.frozen(kw_only=True)
class ProgressConfig:
    """Bars on a terminal (run, generation, each training phase; `unirl.core.run.progress`)."""

    enabled: bool = True
    # Without bars (a log file, UNIRL_PROGRESS=0): the per-step INFO lines (the step line and
    # each phase's summary) every this many RL steps, and for the last step.
    log_every: int = attrs.field(default=1, validator=positive)


@attrs.frozen(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = attrs.field(default=0, validator=non_negative)
    keep: int = attrs.field(default=2, validator=positive)
    export_hf: bool = True


@attrs.frozen(kw_only=True)
class LoggingConfig:
    run_dir: str = "runs/unirl"
    # unirl's log level; the engines (DeepSpeed, torch.distributed, vLLM, transformers) log only
    # errors unless it is DEBUG (`unirl.log_setup`).
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    tensorboard: bool = True


@attrs.frozen(kw_only=True)
class Layout:
    """Values derived once from the config and the world size."""

    world_size: int
    dp: int
    rollout_samples: int
    optimizer_steps_per_rollout: int
    samples_per_rank_per_step: int
    microbatches_per_step: int | None  # None with a token budget: decided per rollout by the plan


def _registered_backend(instance: Any, attribute: attrs.Attribute, value: str) -> None:
    BACKENDS.get(value)


@attrs.frozen(kw_only=True)
class UnirlConfig:
    """The whole run. ``backend`` names a registered `BackendPlugin`; that backend's own section
    (the YAML key is its name, e.g. ``megatron: {attention: padded}``) is ``backend_options``, an
    instance of the plug-in's options class (its defaults when the section is absent)."""

    backend: str = attrs.field(default="deepspeed", validator=_registered_backend)
    old_logprobs: OldLogprobMode = "auto"
    model: ModelConfig = attrs.field(factory=ModelConfig)
    optimizer: OptimizerConfig = attrs.field(factory=OptimizerConfig)
    batch: BatchConfig = attrs.field(factory=BatchConfig)
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    critic: CriticConfig = attrs.field(factory=CriticConfig)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)
    progress: ProgressConfig = attrs.field(factory=ProgressConfig)
    checkpoint: CheckpointConfig = attrs.field(factory=CheckpointConfig)
    logging: LoggingConfig = attrs.field(factory=LoggingConfig)
    backend_options: Any = None
    layout: Layout = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        options_cls = BACKENDS.get(self.backend).options
        if self.backend_options is None:
            object.__setattr__(self, "backend_options", options_cls())
        elif not isinstance(self.backend_options, options_cls):
            raise ConfigError(
                f"backend_options={self.backend_options!r} is not the {self.backend} section; "
                f"pass a {options_cls.__name__} (or a '{self.backend}:' mapping in the YAML)"
            )
        _check_combinations(self)
        object.__setattr__(self, "layout", _derive_layout(self))

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data (what `unirl check` prints and checkpoints store)."""

        def plain(value: Any) -> dict[str, Any]:
            return attrs.asdict(
                value,
                filter=lambda a, _: a.name not in ("layout", "backend_options"),
                value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v,
            )

        return plain(self) | {self.backend: plain(self.backend_options)}


# --------------------------------------------------------------------------------------------
# Combination checks and derived values
# --------------------------------------------------------------------------------------------


def _world_size(cfg: UnirlConfig) -> int:
    if cfg.parallel.world_size is not None:
        return cfg.parallel.world_size
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE={raw!r} is not an integer") from None


def _check_combinations(cfg: UnirlConfig) -> None:
    p, b, a = cfg.parallel, cfg.batch, cfg.algorithm
    # The chosen backend's own rules (what it cannot run, what its options need).
    BACKENDS.get(cfg.backend).check(cfg)
    if p.vpp is not None and p.pp == 1:
        raise ConfigError(
            f"parallel.vpp={p.vpp} needs parallel.pp > 1 (virtual stages interleave pipeline "
            "stages); set parallel.pp >= 2 or remove parallel.vpp"
        )
    if cfg.model.path is None and cfg.model.hf_config is None:
        raise ConfigError(
            "model: set model.path (a local Hugging Face folder) or model.hf_config (a config "
            "dict such as {model_type: llama, hidden_size: 64, ...} for a random init)"
        )
    if b.micro_batch_size is None and b.max_tokens_per_microbatch is None:
        raise ConfigError(
            "batch: set batch.micro_batch_size (samples per microbatch) or "
            "batch.max_tokens_per_microbatch (a token budget per microbatch)"
        )
    if b.micro_batch_size is not None and b.max_tokens_per_microbatch is not None:
        raise ConfigError(
            "batch: set either batch.micro_batch_size (a fixed number of samples per microbatch) "
            "or batch.max_tokens_per_microbatch (a token budget, balanced by length), not both"
        )
    rollout_samples = b.prompts_per_rollout * b.samples_per_prompt
    if rollout_samples % b.samples_per_optimizer_step:
        raise ConfigError(
            f"batch.samples_per_optimizer_step={b.samples_per_optimizer_step} does not divide the "
            f"rollout of batch.prompts_per_rollout x batch.samples_per_prompt = {rollout_samples} "
            "samples; choose a divisor"
        )
    if (
        b.max_tokens_per_microbatch is not None
        and b.max_tokens_per_microbatch < cfg.model.max_seq_len
    ):
        raise ConfigError(
            f"batch.max_tokens_per_microbatch={b.max_tokens_per_microbatch} is smaller than "
            f"model.max_seq_len={cfg.model.max_seq_len}: a full-length sample would not fit; "
            "raise the budget or lower model.max_seq_len"
        )
    # The loss and advantage settings check their own values (names, bounds), once.
    from unirl.core.run.algorithm import advantage_settings, loss_settings

    loss_settings(cfg)
    advantage_settings(cfg)
    rc = a.rollout_correction
    if rc.mode != "none" and cfg.old_logprobs == "rollout":
        raise ConfigError(
            f"algorithm.rollout_correction.mode={rc.mode!r} with old_logprobs: rollout corrects "
            "nothing (the weight exp(old - rollout) is 1 when old log-probs are the rollout's); "
            "use old_logprobs: auto or recompute, or set rollout_correction.mode: none"
        )
    if cfg.rollout.source == "file" and not cfg.rollout.file:
        raise ConfigError("rollout.source: file needs rollout.file (a JSONL path)")
    vllm = cfg.rollout.vllm
    if cfg.rollout.source == "vllm" and (vllm.max_model_len or 0) > cfg.model.max_seq_len:
        raise ConfigError(
            f"rollout.vllm.max_model_len={vllm.max_model_len} exceeds model.max_seq_len="
            f"{cfg.model.max_seq_len}: the trainer could not take the engine's longest samples; "
            "lower it or leave it out (it defaults to model.max_seq_len)"
        )
    _check_prompts(cfg)
    _check_critic(cfg)


def _check_prompts(cfg: UnirlConfig) -> None:
    """rollout.prompts and the keys that only mean something with it."""
    r = cfg.rollout
    if r.prompts is None:
        for key, value in (
            ("rollout.reward", r.reward),
            ("rollout.reward_options", r.reward_options or None),
            ("rollout.skip_long_prompts", r.skip_long_prompts or None),
            ("model.tokenizer", cfg.model.tokenizer),
        ):
            if value is not None:
                raise ConfigError(
                    f"{key}={value!r} applies to prompts read from a file, but rollout.prompts "
                    f"is not set (the built-in tasks score and tokenize themselves); set "
                    f"rollout.prompts or remove {key}"
                )
        return
    if r.source == "file":
        raise ConfigError(
            "rollout.prompts is read by a generating source, but rollout.source: file trains on "
            "finished rollouts; remove rollout.prompts or set rollout.source: sampler"
        )
    if r.reward is None:
        raise ConfigError(
            "rollout.prompts needs rollout.reward: a registered reward such as math_answer, or "
            "'package.module:function'"
        )
    if r.task_options:
        raise ConfigError(
            "rollout.task_options configure rollout.task, which rollout.prompts replaces; remove "
            "rollout.task_options"
        )


def critic_enabled(cfg: UnirlConfig) -> bool:
    """Whether the run trains a critic: ``critic.enabled``, or (unset) whether the advantage
    estimator reads values."""
    if cfg.critic.enabled is not None:
        return cfg.critic.enabled
    from unirl.core.maths.advantages import estimator_needs_values

    return estimator_needs_values(cfg.algorithm.advantage_estimator)


def policy_rl_steps(cfg: UnirlConfig, rl_steps: int) -> int:
    """RL steps in which the policy trains: all but the critic's warm-up."""
    return rl_steps - (cfg.critic.warmup_steps if critic_enabled(cfg) else 0)


def _check_critic(cfg: UnirlConfig) -> None:
    from unirl.core.maths.advantages import estimator_needs_values

    c, estimator = cfg.critic, cfg.algorithm.advantage_estimator
    if c.enabled and not estimator_needs_values(estimator):
        raise ConfigError(
            f"critic.enabled: true, but algorithm.advantage_estimator={estimator!r} does not read "
            "values: the critic would train for nothing; set algorithm.advantage_estimator: gae "
            "or remove critic.enabled"
        )
    if not critic_enabled(cfg):
        defaults = CriticConfig()
        changed = [
            f.name
            for f in attrs.fields(CriticConfig)
            if f.name != "enabled" and getattr(c, f.name) != getattr(defaults, f.name)
        ]
        if changed:
            why = (
                "critic.enabled: false"
                if c.enabled is False
                else f"algorithm.advantage_estimator={estimator!r} reads no values"
            )
            raise ConfigError(
                f"critic.{changed[0]} is set but no critic trains ({why}); remove the critic "
                "section or set algorithm.advantage_estimator: gae"
            )
        return
    plugin = BACKENDS.get(cfg.backend)
    if not plugin.supports_critic:
        raise ConfigError(
            f"backend: {cfg.backend} has no critic (a learned value model for "
            f"algorithm.advantage_estimator={estimator!r}); use backend: deepspeed, megatron or fsdp2, "
            "or an estimator without values (grpo, rloo, reinforce_pp), or critic.enabled: false "
            "with per-token 'values' in a rollout file"
        )
    if c.warmup_steps >= cfg.train.rl_steps:
        raise ConfigError(
            f"critic.warmup_steps={c.warmup_steps} leaves the policy no RL step of "
            f"train.rl_steps={cfg.train.rl_steps}; lower critic.warmup_steps"
        )


def _derive_layout(cfg: UnirlConfig) -> Layout:
    p, b = cfg.parallel, cfg.batch
    world = _world_size(cfg)
    dp = data_parallel_size(world, tp=p.tp, pp=p.pp, cp=p.cp)
    expert_data_parallel_size(world, ep=p.ep, etp=p.etp or p.tp, pp=p.pp)
    rollout_samples = b.prompts_per_rollout * b.samples_per_prompt
    per_rank, microbatches = split_per_rank(b.samples_per_optimizer_step, dp, b.micro_batch_size)
    if cfg.critic.micro_batch_size is not None:
        split_per_rank(b.samples_per_optimizer_step, dp, cfg.critic.micro_batch_size, key="critic")
    steps = rollout_samples // b.samples_per_optimizer_step * b.epochs_per_rollout
    return Layout(
        world_size=world,
        dp=dp,
        rollout_samples=rollout_samples,
        optimizer_steps_per_rollout=steps,
        samples_per_rank_per_step=per_rank,
        microbatches_per_step=microbatches,
    )


def norm_length(cfg: UnirlConfig) -> int:
    """Dr.GRPO's constant length: algorithm.norm_length, else the generation budget."""
    return cfg.algorithm.norm_length or cfg.rollout.max_new_tokens


# --------------------------------------------------------------------------------------------
# Conversion from plain data, with key paths in every error.
# cattrs could structure these classes, but its errors are exception groups without the dotted
# key path and "did you mean" hint our users get here; the converter below is ~80 lines.
# --------------------------------------------------------------------------------------------


_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if attrs.has(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != any(
            isinstance(v, bool) for v in allowed
        ):
            raise ConfigError(f"{path}: {value!r} is not valid; choose one of {list(allowed)}")
        return value
    if attrs.has(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {value!r}")
        return _structure(value, tp, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
            # YAML 1.1 reads "3e-4" (no dot) as a string; users mean the number.
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(args):
            raise ConfigError(f"{path}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(v, t, f"{path}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    raise AssertionError(f"config type {tp!r} at {path} has no converter")


def _structure(
    data: Mapping[str, Any], cls: type, path: str, converted: Mapping[str, Any] | None = None
) -> Any:
    """``cls`` from ``data`` (keys checked, values converted); ``converted``: keyword arguments
    already built by the caller, which the YAML cannot set directly."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls) if f.init and f.name not in (converted or {})}
    kwargs = dict(converted or {})
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown key '{full}'{hint}; valid keys here: {sorted(fields)}")
        kwargs[key] = _convert(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        msg = str(exc)
        # Field validators know only the field name: prefix the section path.
        if path and not msg.startswith(path) and msg.split(" ")[0].split("=")[0] in fields:
            msg = f"{path}.{msg}"
        raise ConfigError(msg) from None


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{'.'.join(keys[: i + 1])}' is not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key.path=value`` strings; values are parsed as YAML (``3``, ``true``, ``[1, 2]``)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return data


def _backend_options(data: dict[str, Any]) -> Any:
    """Pop the backend sections (top-level keys named after a registered backend) from ``data``
    and build the chosen backend's options from its section; a section of another backend is an
    error (it would be silently ignored)."""
    name = data.get("backend", attrs.fields(UnirlConfig).backend.default)
    if not isinstance(name, str):
        raise ConfigError(f"backend: expected a string, got {name!r}")
    plugin = BACKENDS.get(name)
    sections = {key: data.pop(key) for key in list(data) if key in BACKENDS}
    for other in sections:
        if other != name:
            raise ConfigError(
                f"section '{other}:' configures backend {other}, but backend: {name}; remove the "
                f"section or set backend: {other}"
            )
    return _convert(sections.get(name) or {}, plugin.options, name)


def config_from_dict(data: Mapping[str, Any], *, world_size: int | None = None) -> UnirlConfig:
    data = dict(data)
    if world_size is not None:
        parallel = dict(data.get("parallel") or {})
        parallel["world_size"] = world_size
        data["parallel"] = parallel
    options = _backend_options(data)
    return _structure(data, UnirlConfig, "", converted={"backend_options": options})


def load_config(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
) -> UnirlConfig:
    """Load, override and validate a YAML config; every mistake raises `ConfigError`."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(file)!r}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a mapping of sections")
    return config_from_dict(apply_overrides(data, overrides), world_size=world_size)
