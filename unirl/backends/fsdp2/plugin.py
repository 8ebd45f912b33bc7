"""The FSDP2 backend's plug-in: its config section, its rules, its constructor and its contract
layouts. Importing this module imports neither torch.distributed.fsdp nor transformers.

The ``fsdp2:`` section (`Fsdp2Options`); each option is a choice torch's `fully_shard` offers:

- ``sharding``: ``full_shard`` (ZeRO-3-like: parameters resharded after every forward, gathered
  again for the backward), ``shard_grad_op`` (ZeRO-2-like: layers stay gathered from forward to
  backward: more memory, one all-gather less), ``hybrid`` (HSDP: shard within groups of
  ``shard_size`` ranks, replicate across them; gradients all-reduced over the replicas).
- ``cpu_offload``: parameters, gradients and optimizer state live in CPU memory (FSDP2's
  `CPUOffloadPolicy`); each layer is copied to the device when gathered.
- ``grad_reduce``: when the gradients are reduced over the ranks. ``step`` (default): once per
  optimizer step, after the last microbatch's backward (`set_requires_gradient_sync`); until then
  each rank sums its microbatches' gradients unsharded, in fp32 (the reduce dtype): 4 bytes per
  parameter of the whole model on every rank, for one reduce-scatter per step instead of one per
  microbatch. ``microbatch``: a reduce-scatter after every microbatch into the sharded gradient
  (only the shard's memory: for a model whose unsharded fp32 gradients do not fit).
- ``prefetch``: how many decoder layers ahead each layer's all-gather is issued (FSDP2's
  explicit prefetching, `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`):
  ``0`` (default) leaves FSDP2's implicit prefetching, where the next layer's all-gather is issued
  when the CPU reaches that layer; ``n >= 1`` issues the next ``n`` layers' all-gathers at each
  layer's start (forward and backward), so they overlap this layer's compute even when the CPU
  runs barely ahead of the GPU, for ``n`` more gathered layers of memory. The numbers do not change.
- ``sp``: Ulysses sequence-parallel degree. Sequences are split over ``sp`` ranks with core's
  context-parallel layout; attention trades heads for tokens with an all-to-all, so every rank
  attends over whole sequences for ``heads / sp`` heads (`unirl.backends.fsdp2.ulysses`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

from unirl.core.errors import ConfigError
from unirl.core.protocols.backend_plugin import (
    BackendPlugin,
    ContractLayout,
    LazyBuilder,
    OptimizerOffload,
)

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

Sharding = Literal["full_shard", "shard_grad_op", "hybrid"]
GradReduce = Literal["step", "microbatch"]


def _positive(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise ConfigError(f"fsdp2.{attribute.name} must be >= 1, got {value}")


def _non_negative(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ConfigError(f"fsdp2.{attribute.name} must be >= 0, got {value}")


@attrs.frozen(kw_only=True)
class Fsdp2Options:
    """The ``fsdp2:`` section (module docstring)."""

    sharding: Sharding = "full_shard"
    # hybrid only: ranks per shard group (the rest replicate); None = the ranks of one node
    shard_size: int | None = attrs.field(default=None, validator=_positive)
    cpu_offload: bool = False
    grad_reduce: GradReduce = "step"
    prefetch: int = attrs.field(default=0, validator=_non_negative)
    sp: int = attrs.field(default=1, validator=_positive)

    def check_world(self, world_size: int) -> None:
        """The rules that need the number of ranks (known once the processes are up)."""
        if world_size % self.sp:
            raise ConfigError(
                f"fsdp2.sp={self.sp} does not divide the {world_size} ranks; launch a multiple "
                f"of {self.sp} processes or change fsdp2.sp"
            )
        if self.shard_size is not None and (
            world_size % self.shard_size or self.shard_size % self.sp
        ):
            raise ConfigError(
                f"fsdp2.shard_size={self.shard_size} must divide the {world_size} ranks and be a "
                f"multiple of fsdp2.sp={self.sp}"
            )


def check(cfg: UnirlConfig) -> None:
    """FSDP2 shards data-parallel only (sequence parallel is its own ``fsdp2.sp``); ZeRO stages
    are DeepSpeed's words for what ``fsdp2.sharding`` chooses."""
    p, options = cfg.parallel, cfg.backend_options
    for key in ("tp", "pp", "cp", "ep"):
        if getattr(p, key) > 1:
            hint = "fsdp2.sp (Ulysses sequence parallel)" if key == "cp" else "backend: megatron"
            raise ConfigError(
                f"parallel.{key}={getattr(p, key)} is not supported with backend: fsdp2; set "
                f"parallel.{key}: 1 (use {hint})"
            )
    if p.vpp is not None:
        raise ConfigError("parallel.vpp is set but backend: fsdp2 has no pipeline; remove it")
    if p.etp is not None:
        raise ConfigError(
            "parallel.etp is set but backend: fsdp2 has no expert parallel; remove it"
        )
    if p.zero_stage != 0:
        raise ConfigError(
            f"parallel.zero_stage={p.zero_stage} with backend: fsdp2; FSDP2 always shards "
            "parameters, gradients and optimizer state: remove parallel.zero_stage and choose "
            "fsdp2.sharding (full_shard, shard_grad_op or hybrid)"
        )
    if cfg.critic.zero_stage is not None:
        raise ConfigError(
            f"critic.zero_stage={cfg.critic.zero_stage} with backend: fsdp2; the critic is "
            "sharded like the policy (fsdp2.sharding): remove critic.zero_stage"
        )
    if options.cpu_offload and cfg.optimizer.offload == "none":
        raise ConfigError(
            "fsdp2.cpu_offload: true keeps the optimizer state in host memory, but "
            "optimizer.offload: none asks for it on the GPU; remove one of them"
        )
    if options.shard_size is not None and options.sharding != "hybrid":
        raise ConfigError(
            f"fsdp2.shard_size={options.shard_size} is only used with fsdp2.sharding: hybrid "
            f"(got {options.sharding!r}); remove it or set fsdp2.sharding: hybrid"
        )


def _gpu_bytes(cfg: UnirlConfig, offloaded: bool) -> float:
    """Bytes per parameter on one GPU: fp32 sharded weights and gradients and two Adam moments
    (16, over the data-parallel ranks), plus under ``grad_reduce: step`` on several ranks the
    unsharded fp32 gradient sum (4). With CPUOffloadPolicy the sharded state is in host memory:
    only the gathered layer in flight stays, not counted per parameter."""
    options, dp = cfg.backend_options, cfg.layout.dp
    unsharded = 4 if options.grad_reduce == "step" and dp > 1 else 0
    return unsharded + (0 if offloaded else 16 / dp)


def _offloaded_by_option(cfg: UnirlConfig) -> str | None:
    """``fsdp2.cpu_offload: true`` puts every model under CPUOffloadPolicy, the policy's
    optimizer state with it, so ``optimizer.offload: auto`` resolves to offloaded (refusing the
    pair instead would refuse auto, the default, beside the older option)."""
    return "fsdp2.cpu_offload: true" if cfg.backend_options.cpu_offload else None


OFFLOAD = OptimizerOffload(
    how=(
        "FSDP2's CPUOffloadPolicy: the sharded fp32 weights, gradients and Adam moments in host "
        "memory, the Adam step on the CPU, each layer copied to the GPU when gathered (as "
        "fsdp2.cpu_offload: true)"
    ),
    gpu_bytes=_gpu_bytes,
    forced=_offloaded_by_option,
)


PLUGIN = BackendPlugin(
    name="fsdp2",
    options=Fsdp2Options,
    build=LazyBuilder("unirl.backends.fsdp2.backend:Fsdp2Backend"),
    check=check,
    requires=("transformers",),
    install_hint="pip install 'unirl[hf]'",
    supports_critic=True,
    supports_loss_in_head=True,  # `hf.fused_head.FusedLMHead.loss_request`
    supports_routing_replay=True,
    supports_lora=True,  # peft on the policy (`unirl.backends.hf.lora`)
    optimizer_offload=OFFLOAD,  # CPUOffloadPolicy on the policy (`Fsdp2Backend._trained`)
    # full_shard with one process (sharding over one rank still runs FSDP2's gather and reduce
    # hooks) and two; Ulysses sp=2 (two ranks, one sequence split over both; dp = 1).
    layouts=(
        ContractLayout.of("full-dp1", 1, lora=True),
        ContractLayout.of("full-dp2", 2),
        ContractLayout.of("sp2", 2, options={"sp": 2}, critic=True),
        ContractLayout.of("full-dp1-fused", 1, model={"fused_head": True}),
        # per-layer checkpoint keeping attention's output (unirl.backends.kept_attention)
        ContractLayout.of(
            "full-dp1-kept-attention",
            1,
            model={"gradient_checkpointing": True, "recompute_attention": False},
        ),
        # the tiny Qwen3-MoE through transformers' own Qwen3MoeForCausalLM (no expert parallel)
        ContractLayout.of("moe-full-dp2", 2, fixture="moe"),
    ),
)
