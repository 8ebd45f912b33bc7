"""The DeepSpeed backend's plug-in: its config section, its rules, its constructor and its contract
layouts. Importing this module imports neither DeepSpeed nor transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


@attrs.frozen(kw_only=True)
class DeepSpeedOptions:
    """The ``deepspeed:`` section."""

    # Extra DeepSpeed config keys merged over the generated ones (advanced users); keys unirl
    # sets from its own config are refused (`unirl.backends.deepspeed.engine`).
    extra: dict[str, Any] = attrs.field(factory=dict)


def check(cfg: UnirlConfig) -> None:
    """DeepSpeed shards with ZeRO only: no tensor, pipeline or context parallel."""
    p = cfg.parallel
    for key in ("tp", "pp", "cp", "ep"):
        if getattr(p, key) > 1:
            raise ConfigError(
                f"parallel.{key}={getattr(p, key)} is not supported with backend: deepspeed "
                f"(DeepSpeed shards with ZeRO only); set parallel.{key}: 1 or backend: megatron"
            )
    if p.vpp is not None:
        raise ConfigError("parallel.vpp is set but backend: deepspeed has no pipeline; remove it")
    if p.etp is not None:
        raise ConfigError(
            "parallel.etp is set but backend: deepspeed has no expert parallel; remove it"
        )
    if p.zero_stage == 3 and not cfg.model.recompute_attention:
        # ZeRO-3 gathers and releases each layer's parameters inside the checkpointed layer;
        # under the selective checkpoint a released parameter is left in flight (seen in the
        # contract suite on gloo: "expected to be released")
        raise ConfigError(
            "model.recompute_attention: false with backend: deepspeed and parallel.zero_stage: "
            "3: ZeRO-3's parameter gathers do not survive the selective checkpoint; use "
            "zero_stage 0-2, backend: fsdp2, or remove model.recompute_attention"
        )


def _gpu_bytes(cfg: UnirlConfig, offloaded: bool) -> float:
    """Bytes per parameter on one GPU: the weights (bf16: 2, fp32: 4; over the data-parallel
    ranks under ZeRO-3), their gradients (the same; sharded from ZeRO-2), and the optimizer's
    fp32 master weights and gradient partition (bf16 only: 8) and Adam moments (8), sharded from
    ZeRO-1. ZeRO-Offload moves the optimizer's part to host memory."""
    stage, dp, bf16 = cfg.parallel.zero_stage, cfg.layout.dp, cfg.model.dtype == "bf16"
    weights = (2 if bf16 else 4) / (dp if stage == 3 else 1)
    grads = (2 if bf16 else 4) / (dp if stage >= 2 else 1)
    state = 0.0 if offloaded else ((8 if bf16 else 0) + 8) / (dp if stage >= 1 else 1)
    return weights + grads + state


def _refuses_offload(cfg: UnirlConfig) -> str | None:
    if cfg.parallel.zero_stage == 0:
        return "ZeRO-Offload moves ZeRO's optimizer partitions: set parallel.zero_stage >= 1"
    return None


OFFLOAD = OptimizerOffload(
    how=(
        "DeepSpeed's ZeRO-Offload (zero_optimization.offload_optimizer: cpu): fp32 master "
        "weights, gradient partitions and Adam moments in host memory, the client torch AdamW "
        "steps them on the CPU"
    ),
    gpu_bytes=_gpu_bytes,
    refuses=_refuses_offload,
)


PLUGIN = BackendPlugin(
    name="deepspeed",
    options=DeepSpeedOptions,
    build=LazyBuilder("unirl.backends.deepspeed.backend:DeepSpeedBackend"),
    check=check,
    requires=("deepspeed", "transformers"),
    supports_critic=True,
    supports_loss_in_head=True,  # `hf.fused_head.FusedLMHead.loss_request`
    supports_routing_replay=True,
    supports_lora=True,  # peft on the policy (`unirl.backends.hf.lora`)
    optimizer_offload=OFFLOAD,  # ZeRO-Offload of the policy (`engine.deepspeed_config`)
    install_hint="pip install 'unirl[deepspeed,hf]'",
    # ZeRO 0/1/2/3 with one and two processes: optimizer-state (1), gradient (2) and parameter
    # (3) sharding each change where the step's numbers are reduced. zero 1/2 with one process
    # shard nothing, so they run with two only; zero 3 runs with both (one process still
    # partitions through its parameter hooks).
    layouts=(
        ContractLayout.of("zero0-dp1", 1, zero_stage=0, critic=True, lora=True),
        ContractLayout.of("zero1-dp2", 2, zero_stage=1),
        ContractLayout.of("zero2-dp2", 2, zero_stage=2),
        ContractLayout.of("zero3-dp1", 1, zero_stage=3),
        ContractLayout.of("zero3-dp2", 2, zero_stage=3, critic=True, lora=True),
        # model.fused_head: the log-probs from the LM head's input (ZeRO-3 gathers its weight)
        ContractLayout.of("zero3-dp1-fused", 1, model={"fused_head": True}, zero_stage=3),
        # per-layer checkpoint keeping attention's output (unirl.backends.kept_attention), under
        # ZeRO-1 (ZeRO-3 refuses it: `check`)
        ContractLayout.of(
            "zero1-dp2-kept-attention",
            2,
            model={"gradient_checkpointing": True, "recompute_attention": False},
            zero_stage=1,
        ),
        # the tiny Qwen3-MoE through transformers' own Qwen3MoeForCausalLM (no expert parallel)
        ContractLayout.of("moe-zero1-dp2", 2, fixture="moe", zero_stage=1),
    ),
)
