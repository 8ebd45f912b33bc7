"""DeepSpeed engines from unirl's config: the policy (ZeRO 0-3, AdamW, LR schedule, clipping) and
the frozen reference.

Choices, and why:

- The optimizer is a client ``torch.optim.AdamW`` (`unirl.backends.hf.optim`, why there).
- Gradient accumulation is unirl's, not DeepSpeed's: the number of microbatches per optimizer
  step can change from step to step (token-budget plans), so the engine runs with
  ``gradient_accumulation_steps: 1``, the backend calls ``engine.backward(loss,
  scale_wrt_gas=False)`` and marks the last microbatch with
  ``engine.set_gradient_accumulation_boundary(True)``. DeepSpeed then only averages gradients
  over data-parallel ranks, which the backend's ``loss_scale = dp`` cancels.
- The LR schedule is `unirl.core.run.lr_schedule` (shared with Megatron), applied by
  `ScheduledLR`, which DeepSpeed steps after each applied optimizer step and saves in checkpoints.
- ``deepspeed.extra`` (`DeepSpeedOptions.extra`) is merged recursively over the generated config, except for the keys
  unirl owns (batch sizes, accumulation, optimizer, scheduler, precision, ZeRO stage, clipping):
  overriding those would silently break the numbers above, so it is a `ConfigError`.
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from unirl.backends.deepspeed import zero3_no_gather
from unirl.backends.hf.optim import ScheduledLR, adamw
from unirl.core.backend import OptimizerStepStats
from unirl.core.config.run_config import OptimizerConfig, UnirlConfig
from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

# deepspeed.extra key paths whose value unirl sets from its own config -> the key to use instead.
OWNED_KEYS = {
    ("train_batch_size",): "batch.* (unirl plans microbatches itself)",
    ("train_micro_batch_size_per_gpu",): "batch.* (unirl plans microbatches itself)",
    ("gradient_accumulation_steps",): "batch.* (unirl accumulates over the plan's microbatches)",
    ("managed_gradient_accumulation",): "nothing (unirl marks the accumulation boundary)",
    ("optimizer",): "optimizer.*",
    ("scheduler",): "optimizer.lr_schedule / warmup_steps / min_lr_ratio",
    ("gradient_clipping",): "optimizer.grad_clip",
    ("bf16", "enabled"): "model.dtype",
    ("fp16", "enabled"): "model.dtype (fp16 is not supported; use bf16)",
    ("zero_optimization", "stage"): "parallel.zero_stage",
}


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, recursing into nested mappings (a copy; inputs untouched)."""
    out = copy.deepcopy(dict(base))
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _lookup(tree: Mapping[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False, None
        node = node[key]
    return True, node


# deepspeed.extra.zero_optimization keys that set the persistence threshold (alias and field
# name: DeepSpeed 0.19.8 accepts both) or offload the parameters (the deprecated boolean too)
_THRESHOLD_KEYS = ("stage3_param_persistence_threshold", "param_persistence_threshold")
_OFFLOAD_KEYS = ("offload_param", "cpu_offload_param")


def _keeps_gathered_params(extra: Mapping[str, Any]) -> bool:
    """Whether a one-rank ZeRO-3 engine may keep every parameter gathered: not when
    ``deepspeed.extra`` sets the persistence threshold itself, nor when it offloads the
    parameters (their partitions then live in host or NVMe memory, and persistent ones would be
    made on the GPU)."""
    zero = extra.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        return True
    if any(key in zero for key in _THRESHOLD_KEYS):
        return False
    for key in _OFFLOAD_KEYS:
        value = zero.get(key)
        if isinstance(value, Mapping):
            if str(value.get("device", "none")).lower() != "none":
                return False
        elif value:
            return False
    return True


# deepspeed.extra.zero_optimization keys with which the user chooses DeepSpeed's leaf modules
_GRANULARITY_KEYS = (
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "leaf_module",
)


def one_rank_leaf_layers(
    model: torch.nn.Module, dp_size: int, extra: Mapping[str, Any], *, offloaded: bool = False
) -> list[torch.nn.Module]:
    """On one data-parallel rank with every parameter kept gathered (`_keeps_gathered_params`),
    flag each decoder layer (the classes HF's ``_no_split_modules`` names) as a ZeRO-3 "leaf
    module": DeepSpeed then runs its fetch / release hooks once per layer instead of once per
    linear and norm inside it (about a dozen per layer, forward and backward, every microbatch;
    Python work the GPU waits on: README, "Backend throughput"), and reduces the layer's
    gradients from one backward hook on the layer instead of one per parameter. That hook needs
    the layer's input to require grad (under ``model.lora``, whose embeddings are frozen,
    `initialize_trainable` makes it so). Not when ``deepspeed.extra`` chooses leaf modules itself (the granularity threshold
    or ``leaf_module``). Returns the flagged modules."""
    zero = extra.get("zero_optimization", {})
    if dp_size != 1 or offloaded or not _keeps_gathered_params(extra):
        return []
    if isinstance(zero, Mapping) and any(key in zero for key in _GRANULARITY_KEYS):
        return []
    names = sorted(set(getattr(model, "_no_split_modules", None) or ()))
    if not names:
        return []
    from deepspeed.utils import set_z3_leaf_modules

    layers = set_z3_leaf_modules(model, names, raise_if_not_found=False)
    if layers:
        logger.info(
            "ZeRO-3 on one rank: %d decoder layers (%s) are DeepSpeed leaf modules",
            len(layers),
            ", ".join(names),
        )
    return layers


def deepspeed_config(
    cfg: UnirlConfig,
    dp_size: int,
    *,
    optimizer: OptimizerConfig | None = None,
    zero_stage: int | None = None,
    offload: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed config dict of the policy engine, or (``optimizer`` / ``zero_stage`` given)
    of the critic's; ``deepspeed.extra`` is merged into both. ``offload``: ZeRO-Offload of the
    optimizer (``optimizer.offload``): the fp32 master weights, gradient partitions and Adam
    moments in host memory, the client torch AdamW stepping them on the CPU (DeepSpeed's own
    CPU Adam is a JIT-compiled op: `unirl.backends.hf.optim`)."""
    opt = cfg.optimizer if optimizer is None else optimizer
    stage = cfg.parallel.zero_stage if zero_stage is None else zero_stage
    if cfg.model.dtype == "bf16" and stage == 0:
        # Measured on 2 x H200 (benchmarks/results/contract_table/2026-11-30_h200_f6ea5de_deepspeed-bf16.json): ZeRO-0 keeps bf16
        # gradients and bf16 weights, and DeepSpeed 0.19 refuses fp32 accumulation there, so
        # runs drift from fp32 much more than ZeRO 1-3, whose optimizer keeps fp32 masters.
        logger.warning(
            "model.dtype: bf16 with parallel.zero_stage: 0 accumulates gradients and updates "
            "weights in bf16 (no fp32 master weights); use parallel.zero_stage: 1 or more for "
            "bf16 training"
        )
    generated: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": dp_size,
        "gradient_clipping": float(opt.grad_clip or 0.0),
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        "zero_allow_untested_optimizer": True,  # the client torch AdamW under ZeRO
        "steps_per_print": 2**31 - 1,  # unirl logs; DeepSpeed's periodic prints stay off
        "wall_clock_breakdown": False,
    }
    if offload:
        pin = torch.cuda.is_available()
        generated["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
        generated["zero_force_ds_cpu_optimizer"] = False  # the client AdamW, not DeepSpeed's
    if stage == 3 and dp_size == 1 and _keeps_gathered_params(cfg.backend_options.extra):
        # one rank: each parameter's partition is the whole parameter, so keeping every one
        # gathered costs no memory, and ZeRO-3 skips its fetch and release around every module
        # in forward and backward (host work that left the GPU idle: README, "Backend
        # throughput"). deepspeed.extra can set the threshold itself.
        generated["zero_optimization"]["stage3_param_persistence_threshold"] = sys.maxsize
    for path, instead in OWNED_KEYS.items():
        present, value = _lookup(cfg.backend_options.extra, path)
        if not present:
            continue
        ours = _lookup(generated, path)[1]
        if value != ours:
            dotted = ".".join(path)
            raise ConfigError(
                f"deepspeed.extra.{dotted}={value!r} overrides a key unirl sets itself "
                f"(to {ours!r}); remove it and set {instead}"
            )
    return deep_merge(generated, cfg.backend_options.extra)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with its ``@compiler.compile()`` a no-op.

    Under ZeRO, ``deepspeed.initialize`` checks the optimizer against its supported list
    (``is_zero_supported_optimizer``), which first imports this module to add Muon to the list;
    the module decorates its Newton-Schulz kernel with ``torch.compile`` at import, and that
    decoration imports TorchInductor: about 4 s of CPU time per process, for an optimizer unirl
    never uses (its optimizer is the client AdamW, `unirl.backends.hf.optim`). Imported once here
    with ``deepspeed.runtime.compiler.compile`` returning DeepSpeed's own pass-through decorator
    (the attribute restored right after), the check then finds it in ``sys.modules``. A DeepSpeed
    without that module or attribute is left alone."""
    if MUON_MODULE in sys.modules:
        return
    from deepspeed.runtime import compiler

    if not hasattr(compiler, "dummy_decorator") or not hasattr(compiler, "compile"):
        return
    original = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:
        pass
    finally:
        compiler.compile = original


def initialize_trainable(
    model: torch.nn.Module,
    cfg: UnirlConfig,
    opt: OptimizerConfig,
    zero_stage: int,
    *,
    total_steps: int,
    dp_size: int,
    key: str,
    offload: bool = False,
):
    """``deepspeed.initialize`` of a trained model (the policy, the critic) with its own
    optimizer section and ZeRO stage (``offload``: its state in host memory,
    `deepspeed_config`); returns ``(engine, scheduler)``."""
    import deepspeed

    import_muon_uncompiled()
    if zero_stage == 3:
        zero3_no_gather.install()
        layers = one_rank_leaf_layers(model, dp_size, cfg.backend_options.extra)
        if layers and not all(p.requires_grad for p in model.parameters()):
            # A frozen embedding (model.lora): the leaf layers' backward hook needs their input
            # to require grad, which HF's hook on the input embeddings' output gives.
            model.enable_input_require_grads()
    optimizer, schedule = adamw(model, opt, total_steps=total_steps, key=key)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda basic_optimizer: ScheduledLR(basic_optimizer, schedule),
        config=deepspeed_config(
            cfg, dp_size, optimizer=opt, zero_stage=zero_stage, offload=offload
        ),
    )
    return engine, scheduler


def _local_grad_norm(engine: Any) -> float:
    """The norm of the module's (already all-reduced) gradients: DeepSpeed reports none
    without ZeRO and without bf16 (client optimizer path)."""
    grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    return float(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    )


def step_engine(engine: Any) -> OptimizerStepStats:
    """Clip, step, advance the LR schedule; the norm is the global one before clipping."""
    lr = float(engine.get_lr()[0])
    plain = engine.zero_optimization_stage() == 0 and not engine.bfloat16_enabled()
    own_norm = _local_grad_norm(engine) if plain else None
    if own_norm is not None and not math.isfinite(own_norm):
        # DeepSpeed's plain path would apply it: skip, as ZeRO does on a non-finite norm.
        logger.warning("non-finite gradient norm %s: optimizer step skipped", own_norm)
        engine.zero_grad()
        return OptimizerStepStats(grad_norm=own_norm, lr=lr, skipped=True)
    engine.step()
    norm = own_norm if own_norm is not None else engine.get_global_grad_norm()
    if norm is None:
        raise RuntimeError(
            "DeepSpeed reported no gradient norm after the step (ZeRO gradient-norm "
            "computation disabled in deepspeed.extra?)"
        )
    return OptimizerStepStats(grad_norm=float(norm), lr=lr, skipped=not engine.was_step_applied())


def initialize_reference(
    model: torch.nn.Module, cfg: UnirlConfig, device: torch.device, *, dp_size: int
) -> Any:
    """The frozen reference: a ZeRO-3 inference engine when the policy uses ZeRO-3 (parameters
    sharded like the policy's; offloaded to CPU memory with ``model.ref_offload``), else the plain
    module, on `device` or, with ``model.ref_offload``, in CPU memory (moved in per forward pass).
    On one data-parallel rank without the offload, the ZeRO-3 engine keeps every parameter
    gathered and hooks each decoder layer once, as the policy's does (`deepspeed_config`,
    `one_rank_leaf_layers`)."""
    if cfg.parallel.zero_stage == 3:
        import deepspeed

        zero3_no_gather.install()
        zero: dict[str, Any] = {"stage": 3}
        if cfg.model.ref_offload:
            zero["offload_param"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
        elif dp_size == 1:
            zero["stage3_param_persistence_threshold"] = sys.maxsize
            one_rank_leaf_layers(model, dp_size, {})
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": zero,
            "bf16": {"enabled": cfg.model.dtype == "bf16"},
            "steps_per_print": 2**31 - 1,
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine
    return model.to("cpu" if cfg.model.ref_offload else device)
