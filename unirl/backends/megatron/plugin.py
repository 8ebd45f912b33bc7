"""The Megatron backend's plug-in: its config section, its rules, its constructor and its contract
layouts. Importing this module imports neither megatron-core nor transformers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

from unirl.backends.megatron.offload import OFFLOAD
from unirl.core.errors import ConfigError
from unirl.core.protocols.backend_plugin import BackendPlugin, ContractLayout, LazyBuilder

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

logger = logging.getLogger(__name__)

# How a microbatch reaches the attention: "packed" = one token stream, attention kept inside each
# sequence (varlen flash attention on GPUs); "padded" = one right-padded row per sequence (PyTorch
# SDPA); "unfused" = padded rows through megatron-core's own local attention (kept for comparison).
Attention = Literal["packed", "padded", "unfused"]
# A mixture-of-experts model's experts module: "auto" = without TE grouped on CUDA (torch's
# grouped matmul), megatron's SequentialMLP on the CPU, and with TE installed TE's own experts;
# "grouped" / "sequential" force one, with or without TE (same parameters either way; on the CPU
# "grouped" runs torch's per-expert fallback of the grouped matmul: the GPU path's code, at no
# speed-up). A dense model refuses a forced one (it has no experts).
Experts = Literal["auto", "grouped", "sequential"]
# Parts of every dense layer that megatron's selective recompute runs again in backward instead
# of keeping their activations (local spec, no Transformer Engine): "mlp" the whole MLP (its
# [tokens, 2 x intermediate] activations, the largest a layer holds), "core_attn" the attention
# kernel (nothing to gain over flash attention, which keeps no [s, s] scores; for unfused
# attention). Not "layernorm": megatron-core 0.16.1's `CheckpointWithoutOutput()` sets
# ``fp8 = (False is not None)``, so the norms' recompute always takes its Transformer Engine FP8
# branch (NameError on FP8GlobalStateManager without TE).
RecomputeModule = Literal["mlp", "core_attn"]
RECOMPUTE_MODULES = ("mlp", "core_attn")


def _recompute_modules(instance: object, attribute: Any, value: tuple[str, ...]) -> None:
    unknown = [v for v in value if v not in RECOMPUTE_MODULES]
    if unknown or len(set(value)) != len(value):
        raise ConfigError(
            f"megatron.recompute_modules={list(value)!r}: each of {list(RECOMPUTE_MODULES)} at "
            "most once"
        )


@attrs.frozen(kw_only=True)
class MegatronOptions:
    """The ``megatron:`` section."""

    attention: Attention = "packed"
    experts: Experts = "auto"
    # Selective activation recompute (megatron's recompute_granularity: selective) of these layer
    # parts, cheaper than model.gradient_checkpointing's whole layers: the MLP's recompute costs
    # its forward again (~1/4 of a dense layer's training FLOPs) and frees most of its
    # activations; attention is kept (at 64k tokens it is most of the FLOPs). Empty: off.
    recompute_modules: tuple[RecomputeModule, ...] = attrs.field(
        default=(), converter=tuple, validator=_recompute_modules
    )
    # With model.gradient_checkpointing: recompute only the first N layers of each pipeline stage
    # (megatron's block method) and keep the others' activations: the memory a step has left
    # buys back their forward. Null: every layer.
    recompute_layers: int | None = attrs.field(default=None)


def check(cfg: UnirlConfig) -> None:
    """Megatron's own rules: ZeRO-style sharding is its distributed optimizer (stage <= 1),
    context parallel splits packed sequences, and pipeline stages split the layers evenly."""
    p, options = cfg.parallel, cfg.backend_options
    if p.zero_stage > 1:
        raise ConfigError(
            f"parallel.zero_stage={p.zero_stage} with backend: megatron; Megatron shards optimizer "
            "state with its distributed optimizer: use zero_stage 0 (off) or 1 (distributed optimizer)"
        )
    if p.cp > 1 and options.attention != "packed":
        raise ConfigError(
            f"parallel.cp={p.cp} needs megatron.attention: packed (context parallel splits packed "
            f"sequences), got {options.attention!r}; set megatron.attention: packed or parallel.cp: 1"
        )
    if (cfg.critic.zero_stage or 0) > 1:
        raise ConfigError(
            f"critic.zero_stage={cfg.critic.zero_stage} with backend: megatron; the critic's "
            "optimizer is sharded by megatron's distributed optimizer: use 0 (off) or 1"
        )
    if cfg.model.liger_kernels:
        raise ConfigError(
            "model.liger_kernels: true is for the Hugging Face backends (deepspeed, fsdp2); "
            "Megatron builds its own layers: remove it or choose backend: deepspeed or fsdp2"
        )
    _check_experts(cfg)
    _check_recompute(cfg)
    _check_router_losses(cfg)
    if cfg.algorithm.routing_replay != "off" and cfg.model.gradient_checkpointing:
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay!r} with "
            "model.gradient_checkpointing: true on the Megatron backend: megatron's full recompute "
            "reruns each router in the backward, after later microbatches set their experts; turn "
            "gradient_checkpointing off or set algorithm.routing_replay: off"
        )
    if p.sequence_parallel:
        _check_sequence_parallel(cfg)
    _check_shape_splits(cfg)


def _check_recompute(cfg: UnirlConfig) -> None:
    """Selective recompute and full recompute are one megatron setting (its granularity): one or
    the other; ``recompute_layers`` only narrows full recompute, to at most a stage's layers."""
    options, full = cfg.backend_options, cfg.model.gradient_checkpointing
    if options.recompute_modules and full:
        raise ConfigError(
            f"megatron.recompute_modules={list(options.recompute_modules)!r} with "
            "model.gradient_checkpointing: true: megatron recomputes either whole layers or the "
            "listed parts; remove one of them"
        )
    n = options.recompute_layers
    if n is None:
        return
    if not full:
        raise ConfigError(
            f"megatron.recompute_layers={n} narrows model.gradient_checkpointing, which is off; "
            "set model.gradient_checkpointing: true or remove megatron.recompute_layers"
        )
    layers = _hf_config_fields(cfg).get("num_hidden_layers")
    per_stage = layers // (cfg.parallel.pp * (cfg.parallel.vpp or 1)) if layers else None
    if n < 1 or (per_stage is not None and n > per_stage):
        raise ConfigError(
            f"megatron.recompute_layers={n} must be between 1 and the layers of one pipeline "
            f"stage ({per_stage}); null recomputes every layer"
        )


def _check_shape_splits(cfg: UnirlConfig) -> None:
    """The model's sizes that tensor and pipeline parallel split evenly (megatron asserts them
    deep in the build): attention heads and key/value groups by ``tp``, layers by ``pp x vpp``;
    read from model.hf_config or the folder's config.json."""
    p, hf = cfg.parallel, _hf_config_fields(cfg)
    where = "model.hf_config" if cfg.model.hf_config else f"{cfg.model.path}/config.json"
    heads = hf.get("num_attention_heads")
    groups = hf.get("num_key_value_heads", heads)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        if isinstance(value, int) and value % p.tp:
            raise ConfigError(
                f"parallel.tp={p.tp} does not divide {where}'s {name}={value}: tensor parallel "
                "splits the attention heads and key/value groups evenly; choose a tp that "
                "divides both"
            )
    layers = hf.get("num_hidden_layers")
    if isinstance(layers, int) and layers % (p.pp * (p.vpp or 1)):
        raise ConfigError(
            f"{where}'s num_hidden_layers={layers} is not divisible by parallel.pp x "
            f"parallel.vpp = {p.pp} x {p.vpp or 1}; choose sizes that divide the layer count"
        )


def _check_router_losses(cfg: UnirlConfig) -> None:
    """The router losses need every MoE layer's logits of a forward with autograd: no activation
    recompute (its first forward runs the routers without autograd), and under pp > 1 (each
    stage its share, pooled over the pipeline group: `router_stages`) no context parallel."""
    a = cfg.algorithm
    if _hf_config_fields(cfg).get("model_type") != "qwen3_moe" or not (
        a.router_aux_loss_coef or a.router_z_loss_coef
    ):
        return
    coefs = (
        f"algorithm.router_aux_loss_coef={a.router_aux_loss_coef}, "
        f"router_z_loss_coef={a.router_z_loss_coef}"
    )
    if cfg.parallel.pp > 1 and cfg.parallel.cp > 1:
        raise ConfigError(
            f"{coefs} with parallel.pp={cfg.parallel.pp} and parallel.cp={cfg.parallel.cp}: the "
            "Megatron backend pools the router statistics over pipeline stages or over context "
            "ranks, not both; set both coefficients to 0, parallel.pp: 1 or parallel.cp: 1"
        )
    if cfg.model.gradient_checkpointing:
        raise ConfigError(
            f"{coefs} with model.gradient_checkpointing: true: under megatron's full recompute the "
            "routers run without autograd in the forward; set both coefficients to 0 or turn "
            "gradient_checkpointing off"
        )


def _hf_config_fields(cfg: UnirlConfig) -> dict[str, Any]:
    """model.hf_config, else the model folder's config.json (read as plain JSON), else {}."""
    if cfg.model.hf_config:
        return dict(cfg.model.hf_config)
    path = Path(cfg.model.path).expanduser() / "config.json" if cfg.model.path else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def _check_experts(cfg: UnirlConfig) -> None:
    """Expert parallel against the model: only a mixture-of-experts model has experts to split,
    ``ep`` must divide them, and attention tensor parallel under MoE needs megatron's sequence
    parallel (its torch norms refuse it; without it every TP rank routes the same tokens and the
    expert gradients come out ``tp`` times too large): ``tp > 1`` needs
    ``parallel.sequence_parallel: true``, asked for rather than turned on (megatron-core and
    Megatron-LM refuse the combination too; a config key means what it says)."""
    p = cfg.parallel
    hf = _hf_config_fields(cfg)
    # core's reader of the family (it reads num_experts, or num_local_experts: what transformers
    # 5 writes to a saved folder's config.json)
    from unirl.core.config.model_shape import MOE_SHAPES  # here: it imports torch, the plug-in not

    reader = MOE_SHAPES.find(str(hf.get("model_type")))
    experts = reader(hf).num_experts if reader is not None else None
    if not hf:
        # the model is read at build time, where `model.check_hf_config` applies and
        # `model.check_experts_option` refuses megatron.experts on a dense model
        if cfg.backend_options.experts != "auto":
            logger.warning(
                "megatron.experts=%r: model.hf_config is unset and %s has no readable "
                "config.json, so whether the model has experts is known only at build, which "
                "refuses the key on a dense model; set model.hf_config to check it now",
                cfg.backend_options.experts,
                cfg.model.path,
            )
        return
    if experts is None and (p.ep > 1 or p.etp is not None):
        raise ConfigError(
            f"parallel.ep={p.ep}, parallel.etp={p.etp} need a mixture-of-experts model (Qwen3-MoE); "
            f"model_type={hf.get('model_type')!r} is dense: set parallel.ep: 1 and leave "
            "parallel.etp unset"
        )
    if experts is None and cfg.backend_options.experts != "auto":
        raise ConfigError(
            f"megatron.experts={cfg.backend_options.experts!r} chooses a mixture-of-experts "
            f"model's experts module; model_type={hf.get('model_type')!r} is dense: remove it"
        )
    if experts is None:
        return
    if experts % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} does not divide the model's num_experts={experts}; choose an ep "
            "that divides the number of experts"
        )
    if p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"parallel.tp={p.tp} with a mixture-of-experts model needs parallel.sequence_parallel: "
            "true (megatron-core trains MoE layers under tensor parallel only with sequence "
            "parallel: each TP rank routes its own slice of the sequence); set "
            "parallel.sequence_parallel: true, or parallel.tp: 1 and split the experts with "
            "parallel.ep / parallel.etp"
        )


def _check_sequence_parallel(cfg: UnirlConfig) -> None:
    """``parallel.sequence_parallel`` splits sequences over the TP ranks (`sequence_parallel`)."""
    from unirl.core.config.run_config import critic_enabled

    p = cfg.parallel
    if p.tp < 2:
        raise ConfigError(
            f"parallel.sequence_parallel: true needs parallel.tp > 1 (it splits each sequence "
            f"over the tensor-parallel ranks), got tp={p.tp}; raise tp or remove it"
        )
    if p.cp > 1:
        raise ConfigError(
            f"parallel.sequence_parallel: true with parallel.cp={p.cp} is not supported by the "
            "Megatron backend without Transformer Engine (untested combination); use one of them"
        )
    if critic_enabled(cfg):
        raise ConfigError(
            "parallel.sequence_parallel: true with a critic (critic.enabled / advantage_estimator: "
            "gae): the critic's value head does not gather the sequence; remove one of them"
        )


PLUGIN = BackendPlugin(
    name="megatron",
    options=MegatronOptions,
    build=LazyBuilder("unirl.backends.megatron.backend:MegatronBackend"),
    check=check,
    requires=("megatron", "transformers"),
    install_hint="pip install 'unirl[megatron,hf]'",
    supports_critic=True,
    supports_lora=True,  # its own adapters on the parallel linears (`unirl.backends.megatron.lora`)
    # R3 / R2 in `RecordingTopKRouter`, mapped per layer number (`unirl.backends.megatron.moe.replay`)
    supports_routing_replay=True,
    supports_sequence_parallel=True,
    supports_loss_in_head=True,  # `heads.LogprobHead.loss`
    optimizer_offload=OFFLOAD,  # megatron-core's HybridDeviceOptimizer (`offload`)
    # On the CPU megatron-core's own schedules, DDP and optimizer run over gloo (`cpu_compat`).
    # Packed sequences (the default) everywhere; the padded form on one process and under the
    # interleaved schedule; context parallel (packed only); pp2 x vpp2 puts one of the fixture's
    # 4 layers on each virtual stage.
    layouts=(
        ContractLayout.of("tp1-pp1-dp1", 1, lora=True),
        ContractLayout.of("padded", 1, options={"attention": "padded"}),
        # model.fused_head, the loss inside the head for separable losses (every layout:
        # benchmarks/megatron_contract.py --fused-head on)
        ContractLayout.of("fused", 1, model={"fused_head": True}),
        # model.fused_head: auto choosing the fused head (a budget below the fixture's logits)
        ContractLayout.of(
            "fused-auto", 1, model={"fused_head": "auto", "fused_head_logits_gib": 1e-6}
        ),
        ContractLayout.of("fused-tp2", 2, model={"fused_head": True}, tp=2),
        ContractLayout.of("fused-pp2-vpp2", 2, model={"fused_head": True}, pp=2, vpp=2),
        ContractLayout.of(
            "fused-tp2-sp", 2, model={"fused_head": True}, tp=2, sequence_parallel=True
        ),
        # activation recompute: megatron's selective recompute of the MLP, and full
        # recompute of the first layer only (block), the rest keeping their activations
        ContractLayout.of("recompute-selective", 1, options={"recompute_modules": ("mlp",)}),
        ContractLayout.of(
            "recompute-block",
            1,
            model={"gradient_checkpointing": True},
            options={"recompute_layers": 1},
        ),
        # whole-layer recompute keeping attention's output (unirl.backends.kept_attention)
        ContractLayout.of(
            "recompute-kept-attention",
            1,
            model={"gradient_checkpointing": True, "recompute_attention": False},
        ),
        ContractLayout.of("dp2", 2),
        ContractLayout.of("tp2", 2, tp=2, critic=True),
        ContractLayout.of("tp2-sp", 2, tp=2, sequence_parallel=True, lora=True),
        ContractLayout.of(
            "padded-tp2-sp", 2, options={"attention": "padded"}, tp=2, sequence_parallel=True
        ),
        ContractLayout.of("pp2", 2, pp=2, lora=True),
        ContractLayout.of("pp2-vpp2", 2, pp=2, vpp=2, critic=True),
        ContractLayout.of("padded-pp2-vpp2", 2, options={"attention": "padded"}, pp=2, vpp=2),
        ContractLayout.of("cp2", 2, cp=2),
        ContractLayout.of("zero1-dp2", 2, zero_stage=1),
        ContractLayout.of("tp2-pp2", 4, tp=2, pp=2),
        # The tiny Qwen3-MoE (8 experts, top-2): expert parallel over the data ranks (ep2: each
        # rank 4 experts, tokens exchanged all-to-all), each expert split over 2 ranks (etp2),
        # and with the pipeline (one MoE layer per stage). Those marked lora also run the LoRA
        # contract with expert adapters (`model.lora.target_experts`).
        ContractLayout.of("moe-ep1", 1, fixture="moe"),
        # the GPU's experts path on the CPU (torch's fallback of the grouped matmul): the
        # grouped experts, their weight gradients into DDP's main_grad, the sync-free dispatcher
        ContractLayout.of(
            "moe-ep1-grouped", 1, fixture="moe", options={"experts": "grouped"}, lora=True
        ),
        ContractLayout.of(
            "moe-ep2-grouped", 2, fixture="moe", ep=2, options={"experts": "grouped"}, lora=True
        ),
        ContractLayout.of("moe-ep2", 2, fixture="moe", ep=2, lora=True),
        # attention TP 2 with sequence parallel, the experts over the same two ranks (ep 2,
        # etp 1: megatron's expert layout folds EP into the TP ranks), each rank routing its
        # slice of the sequence; and one MoE layer per pipeline stage
        ContractLayout.of(
            "moe-tp2-ep2-sp",
            2,
            fixture="moe",
            tp=2,
            ep=2,
            etp=1,
            sequence_parallel=True,
            lora=True,
        ),
        ContractLayout.of("moe-pp2", 2, fixture="moe", pp=2, lora=True),
        ContractLayout.of("moe-ep2-etp2", 4, fixture="moe", ep=2, etp=2),
        ContractLayout.of("moe-pp2-ep2", 4, fixture="moe", pp=2, ep=2, lora=True),
    ),
)
