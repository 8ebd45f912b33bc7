"""megatron-core's DistributedDataParallel and optimizer from unirl's config, with unirl's LR schedule.

- ``parallel.zero_stage: 0``: each data-parallel rank keeps the whole optimizer state;
  ``zero_stage: 1``: megatron's distributed optimizer (``use_distributed_optimizer=True``: the
  fp32 main weights and Adam moments sharded over data-parallel ranks, gradients reduce-scattered,
  weights all-gathered after the step). Stages 2 and 3 have no megatron equivalent here.
- AdamW (torch's, when neither Transformer Engine nor Apex is installed) with decoupled weight
  decay on matrices and embeddings only: megatron's default parameter groups give 1-D parameters
  (norm weights, biases) ``wd_mult = 0``, the convention of the DeepSpeed backend. torch's AdamW
  runs as its one fused kernel per tensor group (`fuse_adam`), not megatron's foreach default.
- bf16: bf16 weights and activations, fp32 main weights and fp32 gradient reduction in the
  optimizer (megatron's mixed precision); fp32: everything fp32.
- Gradient clipping by the global norm (``optimizer.grad_clip``; none: the norm is still computed,
  for the metrics); megatron reduces the norm over data-, tensor- and pipeline-parallel ranks and
  skips parameters duplicated across them.
- The learning rate is `unirl.core.run.lr_schedule.learning_rate(steps_done)`, written into every
  parameter group before each step (megatron's own scheduler is not used).
- ``optimizer.offload`` (the policy's, `unirl.core.config.optimizer_offload`): megatron-core's
  own `HybridDeviceOptimizer` with every parameter offloaded (``optimizer_offload_fraction=1``),
  under the distributed optimizer as megatron's precision-aware optimizer: the fp32 master
  weights and both Adam moments live only in host memory, torch's fused AdamW steps them on the
  CPU, the gradients (the fp32 grad buffer's shard) are copied to the host and the updated
  weights back into the bf16 parameters, each parameter's copies overlapped with the CPU step of
  the others (`offload_config`). On the GPU the weights and the gradient buffer remain: 6 bytes
  per parameter instead of 18 under bf16.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer

from unirl.core.backend import AdamStepSettings
from unirl.core.config.run_config import OptimizerConfig, UnirlConfig
from unirl.core.run.lr_schedule import learning_rate

logger = logging.getLogger(__name__)


def use_distributed_optimizer(cfg: UnirlConfig) -> bool:
    """``parallel.zero_stage: 1`` (the config refuses 2 and 3 with backend: megatron)."""
    return cfg.parallel.zero_stage == 1


def mark_tensor_parallel_params(chunks: Sequence[torch.nn.Module]) -> None:
    """Set megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes on the sharded
    weights (and column-parallel biases).

    megatron-core 0.16.1 sets them only inside its weight init, which `build_model_chunks` skips
    (``perform_initialization=False``). Without them every parameter counts as a TP duplicate, so
    the gradient norm (and clipping) sees only tensor-parallel rank 0's shards: measured 3.41
    instead of 3.99 at TP=2 on the contract fixture. Idempotent.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    def mark(param: torch.Tensor | None, dim: int) -> None:
        if param is not None and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                mark(module.weight, 0)
                mark(getattr(module, "bias", None), 0)
            elif isinstance(module, RowParallelLinear):
                mark(module.weight, 1)  # its bias is whole on every rank


def wrap_ddp(
    chunks: Sequence[torch.nn.Module], cfg: UnirlConfig, *, distributed: bool | None = None
) -> list[DistributedDataParallel]:
    """Each model chunk in megatron's DDP (contiguous fp32 gradient buffers, reduced once per
    optimizer step by `finalize_model_grads` at the end of the schedule). ``distributed``: the
    distributed optimizer (default: the policy's ``parallel.zero_stage``)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer(cfg)
        if distributed is None
        else distributed,
        check_for_nan_in_grad=False,
    )
    mark_tensor_parallel_params(chunks)
    wrapped = []
    for i, chunk in enumerate(chunks):
        wrapped.append(
            DistributedDataParallel(
                config=chunk.config,
                ddp_config=ddp_config,
                module=chunk,
                # megatron-LM's choice: only the first chunk's buffers are bucketed under VPP
                disable_bucketing=i > 0,
            )
        )
    for ddp in wrapped:
        # the schedule reads its config from the first chunk; every chunk gets the same hooks
        ddp.config.finalize_model_grads_func = finalize_model_grads
        ddp.config.no_sync_func = [d.no_sync for d in wrapped] if len(wrapped) > 1 else ddp.no_sync
    return wrapped


def offload_config(config: MegatronOptimizerConfig, on_gpu: bool) -> None:
    """Turn ``config`` into megatron's offloaded optimizer (module docstring), in place.

    Precision-aware is what keeps the fp32 master weights off the GPU: without it the
    distributed optimizer makes an fp32 copy of every shard on the GPU and the hybrid optimizer
    offloads a second copy of that (10 bytes per parameter left on the GPU, not 6). megatron-core
    0.16.1 refuses ``use_precision_aware_optimizer=True`` in ``OptimizerConfig.__post_init__``
    without Transformer Engine (``is_te_min_version`` compares TE's absent version, a TypeError,
    before the line that skips TE's checks under ``optimizer_cpu_offload``; TE's FusedAdam is
    used only without offload), so the two flags are set after the check, to the values the
    check computes with offload on. Pinned host buffers and the side streams that overlap the
    copies need a GPU; on the CPU (the tests) the host copies are plain tensors."""
    config.optimizer_cpu_offload = True
    config.optimizer_offload_fraction = 1.0
    config.overlap_cpu_optimizer_d2h_h2d = on_gpu
    config.pin_cpu_grads = on_gpu
    config.pin_cpu_params = on_gpu
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True


def build_optimizer(
    ddp_chunks: Sequence[DistributedDataParallel],
    cfg: UnirlConfig,
    *,
    optimizer: OptimizerConfig | None = None,
    distributed: bool | None = None,
    offload: bool = False,
) -> Any:
    """megatron's optimizer over the DDP-wrapped chunks (see the module docstring); the policy's
    ``optimizer`` section unless another (the critic's) is given; ``offload``: its state in host
    memory (`offload_config`, the distributed optimizer only)."""
    opt = cfg.optimizer if optimizer is None else optimizer
    distributed = use_distributed_optimizer(cfg) if distributed is None else distributed
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    clip = float(opt.grad_clip) if opt.grad_clip else float("inf")
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.lr * opt.min_lr_ratio,
        weight_decay=opt.weight_decay,
        adam_beta1=float(opt.betas[0]),
        adam_beta2=float(opt.betas[1]),
        adam_eps=opt.eps,
        clip_grad=clip,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
    )
    if offload:
        assert distributed, "the megatron plug-in refuses optimizer.offload without zero_stage 1"
        on_gpu = next(ddp_chunks[0].parameters()).is_cuda
        offload_config(config, on_gpu)
    built = get_megatron_optimizer(config, list(ddp_chunks))
    if offload and on_gpu:
        pin_host_masters(built)
    logger.info("megatron optimizer: %s", fuse_adam(built))
    return built


def pin_host_masters(optimizer: Any) -> None:
    """Page-lock the offloaded optimizer's fp32 master copies, in place (``.data``: every map of
    megatron's HybridDeviceOptimizer keys the tensor object, which stays). megatron pins the bf16
    copy it takes from the GPU, then makes the fp32 master with ``.float()``, which is pageable:
    each step's weight copy back to the GPU would then be a synchronous pageable copy instead of
    an asynchronous one overlapped with the next parameters' host step."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for inner in inner_optimizers(optimizer):
        if isinstance(inner, HybridDeviceOptimizer):
            for sub in inner.cpu_optimizers:
                for group in sub.param_groups:
                    for param in group["params"]:
                        if not param.is_pinned():
                            param.data = param.data.pin_memory()


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside a (possibly chained) megatron optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o.optimizer for o in (chained if chained is not None else [optimizer])]


def adam_step(value: float, group: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """An Adam ``step`` count where torch's AdamW keeps it for ``group``: on the parameter's
    device in float32 for the fused (or capturable) kernels, which read it there; on the CPU
    otherwise (adam.py's own rule)."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(value), dtype=torch.float32, device=param.device)
    return torch.tensor(float(value))


def fuse_adam(optimizer: Any) -> str:
    """Run torch's AdamW as its fused kernel (``fused=True``); returns what was chosen, and why.

    Without Transformer Engine or Apex megatron-core 0.16.1 builds ``torch.optim.AdamW`` with
    torch's default, the foreach path: about 18 passes over the fp32 main weights, gradients
    and moments per step (lerp, mul, addcmul, sqrt, div, add, addcdiv), against the fused
    kernel's 7 (read weight, gradient, both moments; write weight, both moments). The update is
    the same AdamW. Idempotent; also re-applied after a checkpoint's parameter groups replace
    these (a checkpoint written before this kept ``fused: None``)."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    fused = kept = 0
    hybrids = [o for o in inner_optimizers(optimizer) if isinstance(o, HybridDeviceOptimizer)]
    if hybrids:  # megatron builds its host AdamWs with fused=True (torch's CPU kernel)
        copies = sum(
            len(g["params"]) for h in hybrids for o in h.cpu_optimizers for g in o.param_groups
        )
        return (
            f"megatron-core's HybridDeviceOptimizer x {len(hybrids)} (optimizer.offload): torch "
            f"AdamW (fused) over host copies of {copies} tensor(s)"
        )
    for inner in inner_optimizers(optimizer):
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            return f"{type(inner).__name__} (Transformer Engine's or Apex's fused Adam)"
        for group in inner.param_groups:
            params = group["params"]
            if group.get("differentiable") or not all(
                p.device.type in devices and p.is_floating_point() for p in params
            ):
                kept += 1
                continue
            group["fused"], group["foreach"] = True, False
            fused += 1
            for p in params:
                state = inner.state.get(p)
                if state and "step" in state:
                    state["step"] = adam_step(float(state["step"]), group, p)
    if not fused:
        return "torch AdamW, foreach (no parameter group on a device with torch's fused Adam)"
    return f"torch AdamW, fused kernel ({fused} parameter group(s); {kept} kept foreach)"


def param_groups(optimizer: Any) -> list[dict[str, Any]]:
    """Every parameter group of a (possibly chained) megatron optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    optimizers = chained if chained is not None else [optimizer]
    return [group for o in optimizers for group in o.param_groups]


def apply_schedule(
    optimizer: Any,
    cfg: UnirlConfig,
    steps_done: int,
    total_steps: int,
    *,
    section: OptimizerConfig | None = None,
) -> float:
    """Write the step's learning rate (and each group's weight decay: ``weight_decay *
    wd_mult``, 0 for 1-D parameters) into the optimizer; returns the learning rate. ``section``:
    the optimizer config (default the policy's ``optimizer``)."""
    opt = cfg.optimizer if section is None else section
    lr = learning_rate(steps_done, opt, total_steps)
    for group in param_groups(optimizer):
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = opt.weight_decay * group.get("wd_mult", 1.0)
    return lr


def apply_step_settings(optimizer: Any, settings: AdamStepSettings) -> float:
    """The caller's AdamW settings for the next step (`unirl.core.backend.TakesStepSettings`,
    the Tinker API's ``optim_step``) written into every parameter group (weight decay times the
    group's ``wd_mult``: 0 for 1-D parameters, as `apply_schedule`) and the clip into each
    (chained) megatron optimizer's config, which its ``step`` reads; returns the LR."""
    for group in param_groups(optimizer):
        group["lr"] = settings.lr * group.get("lr_mult", 1.0)
        group["betas"] = (settings.beta1, settings.beta2)
        group["eps"] = settings.eps
        group["weight_decay"] = settings.weight_decay * group.get("wd_mult", 1.0)
    # grad_clip 0: no clipping, but megatron computes the norm only when clip_grad > 0
    clip = float(settings.grad_clip) if settings.grad_clip else float("inf")
    chained = getattr(optimizer, "chained_optimizers", None)
    for inner in chained if chained is not None else [optimizer]:
        inner.config.clip_grad = clip
    return settings.lr
