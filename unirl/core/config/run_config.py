"""The run configuration: frozen attrs classes loaded from YAML, validated once, with derived values.

A config is plain data with its defaults on the schema only. `load_config` reads YAML (safe loader),
applies ``--set key.path=value`` overrides (`unirl.core.config.overrides`), converts to the section
classes (`unirl.core.config.sections`, with `unirl.core.config.from_data`) and checks every combination; each mistake raises `ConfigError` naming the key path, the value seen and what would be
valid. Derived values (data-parallel size, optimizer steps per rollout, microbatches per step) are
computed once, in `Layout`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import yaml

from unirl.core.config.from_data import _convert, _structure
from unirl.core.config.overrides import apply_overrides
from unirl.core.config.recompute_rules import check_recompute_attention
from unirl.core.config.routing_replay import check_routing_replay
from unirl.core.config.rules import check_registered_rules
from unirl.core.config.sections.algorithm import (
    AlgorithmConfig,
    CriticConfig,
    KLConfig,
    KLInRewardConfig,
    RolloutCorrectionConfig,
)
from unirl.core.config.sections.eval import EvalConfig
from unirl.core.config.sections.model import Dtype, ModelConfig
from unirl.core.config.sections.output import (
    CheckpointConfig,
    LoggingConfig,
    ProgressConfig,
    WandbConfig,
)
from unirl.core.config.sections.rollout import RolloutConfig
from unirl.core.config.sections.training import (
    BatchConfig,
    OptimizerConfig,
    ParallelConfig,
    Schedule,
    TrainConfig,
)
from unirl.core.data.plan import split_per_rank
from unirl.core.errors import ConfigError
from unirl.core.protocols.backend_plugin import BACKENDS
from unirl.core.protocols.source_plugin import SOURCES
from unirl.core.topology import data_parallel_size, expert_data_parallel_size

__all__ = [
    "AlgorithmConfig",
    "BatchConfig",
    "CheckpointConfig",
    "CriticConfig",
    "Dtype",
    "EvalConfig",
    "KLConfig",
    "KLInRewardConfig",
    "Layout",
    "LoggingConfig",
    "ModelConfig",
    "OldLogprobMode",
    "OptimizerConfig",
    "ParallelConfig",
    "ProgressConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "Schedule",
    "TrainConfig",
    "UnirlConfig",
    "WandbConfig",
    "apply_overrides",
    "config_from_dict",
    "critic_enabled",
    "load_config",
    "norm_length",
    "policy_rl_steps",
]

OldLogprobMode = Literal["auto", "recompute", "reuse", "rollout"]


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
    # Held-out prompts evaluated during training (unirl/rollouts/eval/evaluator.py); None: no evaluation.
    eval: EvalConfig | None = None
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
                filter=lambda a, _: a.name not in ("layout", "backend_options", "source_options"),
                value_serializer=lambda _i, _a, v: list(v) if isinstance(v, tuple) else v,
            )

        data = plain(self) | {self.backend: plain(self.backend_options)}
        if self.rollout.source_options is not None:
            data["rollout"][self.rollout.source] = plain(self.rollout.source_options)
        return data


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
    plugin = BACKENDS.get(cfg.backend)
    if p.sequence_parallel and not plugin.supports_sequence_parallel:
        raise ConfigError(
            f"parallel.sequence_parallel: true with backend: {cfg.backend}, which has no sequence "
            "parallel; remove it or use a backend that has (megatron)"
        )
    plugin.check(cfg)
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
    rc = a.rollout_correction
    if rc.mode != "none" and cfg.old_logprobs == "rollout":
        raise ConfigError(
            f"algorithm.rollout_correction.mode={rc.mode!r} with old_logprobs: rollout corrects "
            "nothing (the weight exp(old - rollout) is 1 when old log-probs are the rollout's); "
            "use old_logprobs: auto or recompute, or set rollout_correction.mode: none"
        )
    if a.decoupled is True and cfg.old_logprobs == "rollout":
        raise ConfigError(
            "algorithm.decoupled: true with old_logprobs: rollout makes the proximal policy the "
            "behaviour one (weight exp(0) = 1 everywhere); use old_logprobs: auto or recompute, "
            "or set algorithm.decoupled: false"
        )
    if cfg.train.max_staleness and not SOURCES.get(cfg.rollout.source).generates:
        raise ConfigError(
            f"train.max_staleness={cfg.train.max_staleness} generates rollouts ahead of "
            f"training, but rollout.source: {cfg.rollout.source} reads finished ones (their "
            "staleness is in their policy_version); set train.max_staleness: 0"
        )
    # The chosen rollout source's own rules (what it needs, what its options must fit).
    SOURCES.get(cfg.rollout.source).check(cfg)
    # The rules of the rollout-owned keys (prompts, rewards, stops, environment, eval), which
    # unirl.rollouts registers.
    check_registered_rules(cfg)
    _check_wandb(cfg)
    _check_critic(cfg)
    _check_lora(cfg)
    _check_offload(cfg)
    check_recompute_attention(cfg.model)
    check_routing_replay(cfg)


def _check_lora(cfg: UnirlConfig) -> None:
    """``model.lora`` needs a backend that trains an adapter (its plug-in's ``supports_lora``)."""
    if cfg.model.lora is not None and not BACKENDS.get(cfg.backend).supports_lora:
        lora_backends = [n for n in BACKENDS.names() if BACKENDS.get(n).supports_lora]
        raise ConfigError(
            f"model.lora is set but backend: {cfg.backend} trains no adapter; remove model.lora "
            f"or use one of {lora_backends}"
        )


def _check_offload(cfg: UnirlConfig) -> None:
    """``optimizer.offload: cpu`` needs a backend (and layout) that offloads (its plug-in's
    ``optimizer_offload``); the critic's optimizer is never offloaded
    (`unirl.core.config.optimizer_offload` decides ``auto``), so none of its offload keys
    changes anything and each is refused; ``auto``'s planning keys change nothing under
    ``cpu`` / ``none`` and are refused there."""
    default = type(cfg.critic.optimizer)()
    for key in ("offload", "offload_gpu_gib", "offload_state_fraction"):
        if getattr(cfg.critic.optimizer, key) != getattr(default, key):
            raise ConfigError(
                f"critic.optimizer.{key}={getattr(cfg.critic.optimizer, key)!r} is set, but the "
                f"critic's optimizer state always stays on the GPU (only the policy's is "
                f"offloaded: optimizer.{key}); remove critic.optimizer.{key}"
            )
    if cfg.optimizer.offload != "auto":
        for key in ("offload_gpu_gib", "offload_state_fraction"):
            if getattr(cfg.optimizer, key) != getattr(default, key):
                raise ConfigError(
                    f"optimizer.{key}={getattr(cfg.optimizer, key)!r} plans optimizer.offload: "
                    f"auto, but optimizer.offload is {cfg.optimizer.offload!r}, which ignores "
                    f"it; remove optimizer.{key} or set optimizer.offload: auto"
                )
    if cfg.optimizer.offload != "cpu":
        return
    support = BACKENDS.get(cfg.backend).optimizer_offload
    if support is None:
        offloading = [n for n in BACKENDS.names() if BACKENDS.get(n).optimizer_offload]
        raise ConfigError(
            f"optimizer.offload: cpu with backend: {cfg.backend}, which cannot offload its "
            f"optimizer state; set optimizer.offload: none or use one of {offloading}"
        )
    if cfg.model.lora is not None:
        raise ConfigError(
            "optimizer.offload: cpu with model.lora: the optimizer holds only the adapter (a few "
            "MiB); set optimizer.offload: none"
        )
    why = support.refuses(cfg)
    if why is not None:
        raise ConfigError(f"optimizer.offload: cpu with backend: {cfg.backend}: {why}")


def _check_wandb(cfg: UnirlConfig) -> None:
    """A configured W&B that cannot run is refused before any work (unirl.core.run.wandb_log
    says why: a warning would scroll away while the whole run goes unlogged)."""
    if cfg.logging.wandb is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "logging.wandb is set but Weights & Biases is not installed: pip install -e "
            "'.[wandb]' (or pip install wandb), or remove logging.wandb"
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


def _rollout_section(data: dict[str, Any]) -> RolloutConfig:
    """Pop ``rollout`` from ``data`` and build it, with the chosen source's options built from
    its section (a key of ``rollout`` named after a registered source); a section of another
    source is an error (it would be silently ignored)."""
    rollout = data.pop("rollout", {})
    if not isinstance(rollout, Mapping):
        raise ConfigError(f"rollout: expected a mapping of keys, got {rollout!r}")
    rollout = dict(rollout)
    name = rollout.get("source", attrs.fields(RolloutConfig).source.default)
    if not isinstance(name, str):
        raise ConfigError(f"rollout.source: expected a string, got {name!r}")
    plugin = SOURCES.get(name)
    keys = {f.name for f in attrs.fields(RolloutConfig)}
    if plugin.options is not None and name in keys:
        raise ConfigError(
            f"rollout source {name!r} has an options section, but rollout.{name} is a key of "
            "the rollout section itself; register the plug-in under another name"
        )
    sections = {
        key: rollout.pop(key) for key in list(rollout) if key in SOURCES and key not in keys
    }
    for other in sections:
        if other != name:
            raise ConfigError(
                f"section 'rollout.{other}:' configures rollout source {other}, but "
                f"rollout.source: {name}; remove the section or set rollout.source: {other}"
            )
    options = None
    if plugin.options is not None:
        options = _convert(sections.get(name) or {}, plugin.options, f"rollout.{name}")
    elif name in sections:
        raise ConfigError(
            f"section 'rollout.{name}:': rollout source {name} has no options; remove it"
        )
    return _structure(rollout, RolloutConfig, "rollout", converted={"source_options": options})


def config_from_dict(data: Mapping[str, Any], *, world_size: int | None = None) -> UnirlConfig:
    data = dict(data)
    if world_size is not None:
        parallel = dict(data.get("parallel") or {})
        parallel["world_size"] = world_size
        data["parallel"] = parallel
    options = _backend_options(data)
    rollout = _rollout_section(data)
    return _structure(
        data,
        UnirlConfig,
        "",
        converted={"backend_options": options, "rollout": rollout},
        also_valid=["rollout", *BACKENDS.names()],
    )


def load_config(
    path: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    world_size: int | None = None,
) -> UnirlConfig:
    """Load, override and validate a YAML config; every mistake raises `ConfigError`."""
    return config_from_dict(load_config_data(path, overrides), world_size=world_size)


def load_config_data(path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The YAML file with ``--set`` overrides applied, as plain data: what the user set
    (`unirl check` marks it in the resolved config)."""
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
    return apply_overrides(data, overrides)
