"""Per-token log-probs (and entropy) from local, possibly vocabulary-sharded logits.

This is the seam between a backend, which makes logits, and the core, which needs log-probs.
With ``z = logits / temperature`` and targets ``y``::

    logp_t = z[t, y_t] - logsumexp_v z[t, v]
    H_t    = logsumexp_v z[t, v] - sum_v p[t, v] z[t, v],   p = softmax(z)

A naive ``log_softmax(logits.float()).gather(...)`` holds an fp32 copy, the log-softmax and its
gradient: about 6x the bf16 logits' bytes, the most common out-of-memory in RL training. Here a
custom autograd function saves only the input logits and per-token statistics (logsumexp, and
E[z] when the entropy's gradient is wanted), and recomputes the softmax in backward, writing
one gradient buffer of the logits' dtype. On CUDA with Triton importable it runs two fused
kernels (`unirl.core.maths.kernels.logprobs_triton`: one pass for the statistics, one for the
gradient); otherwise a chunked PyTorch path over ``chunk_size`` token rows at a time.

Tensor parallel (Megatron's ``parallel_output=True``): rank r holds vocabulary ids
``[r * V_local, (r + 1) * V_local)`` and the last shard may end in padding beyond ``vocab_size``.
Each rank computes local statistics (max, sum of exps, target logit, sum of exp * z), then one
MAX and one SUM all-reduce combine them; backward needs no communication because the global
logsumexp and E[z] are saved. Temperature applies to log-probs and entropy alike.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from types import ModuleType
from typing import Any, Literal, overload

import torch
import torch.distributed as dist

from unirl.core.errors import LossInputError

logger = logging.getLogger(__name__)

Kernel = Literal["auto", "torch", "triton"]
_KERNELS = ("auto", "torch", "triton")

# Rows per chunk on the PyTorch path: about 2**24 fp32 elements (64 MiB) per temporary.
_CHUNK_ELEMENTS = 1 << 24


@functools.cache
def _triton_kernels() -> ModuleType | None:
    """The Triton kernel module, or None when Triton is not installed (never imported then)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from unirl.core.maths.kernels import logprobs_triton
    except ImportError as err:  # a broken Triton install: fall back, but say so once
        logger.warning("triton is installed but unusable (%s); using the PyTorch path", err)
        return None
    return logprobs_triton


def triton_available() -> bool:
    """Whether the fused Triton kernels can be used for CUDA tensors."""
    return _triton_kernels() is not None


# --- the PyTorch path (CPU, and the reference for the kernels) --------------------------------


def _scaled_fp32(chunk: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """A fresh fp32 copy of ``chunk / temperature`` (the caller may modify it in place)."""
    return chunk.to(torch.float32, copy=True).mul_(inv_temp)


def _torch_local_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    inv_temp: float,
    with_entropy: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    n_rows = logits.shape[0]
    f32 = dict(dtype=torch.float32, device=logits.device)
    row_max = torch.empty(n_rows, **f32)
    sumexp = torch.empty(n_rows, **f32)
    sum_pz = torch.empty(n_rows, **f32) if with_entropy else None
    target_logit = torch.empty(n_rows, **f32)
    for lo in range(0, n_rows, chunk_size):
        hi = min(lo + chunk_size, n_rows)
        z = _scaled_fp32(logits[lo:hi, :n_valid], inv_temp)  # the chunk's fp32 copy
        m = z.amax(dim=1)
        e = (z - m[:, None]).exp_()
        row_max[lo:hi] = m
        sumexp[lo:hi] = e.sum(dim=1)
        if sum_pz is not None:
            sum_pz[lo:hi] = e.mul_(z).sum(dim=1)
        local = targets[lo:hi] - vocab_start
        own = (local >= 0) & (local < n_valid)
        picked = z.gather(1, local.clamp(0, n_valid - 1)[:, None]).squeeze(1)
        target_logit[lo:hi] = torch.where(own, picked, 0.0)
    return row_max, sumexp, sum_pz, target_logit


def _torch_logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    n_valid: int,
    inv_temp: float,
    lse: torch.Tensor,
    g_logp: torch.Tensor,
    mean_z: torch.Tensor | None,
    g_entropy: torch.Tensor | None,
    chunk_size: int,
) -> torch.Tensor:
    n_rows, n_cols = logits.shape
    grad = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    grad[:, n_valid:] = 0  # padding beyond the true vocabulary
    for lo in range(0, n_rows, chunk_size):
        hi = min(lo + chunk_size, n_rows)
        z = _scaled_fp32(logits[lo:hi, :n_valid], inv_temp)
        p = (z - lse[lo:hi, None]).exp_()
        g = g_logp[lo:hi, None]
        if g_entropy is not None:
            # dH/dz_v = p_v (E[z] - z_v)
            d = z.neg_().add_(mean_z[lo:hi, None]).mul_(p).mul_(g_entropy[lo:hi, None])
            d.sub_(p.mul_(g))
        else:
            d = p.mul_(-g)  # d logp / dz_v = onehot_v - p_v
        local = targets[lo:hi] - vocab_start
        own = (local >= 0) & (local < n_valid)
        d.scatter_add_(
            1, local.clamp(0, n_valid - 1)[:, None], torch.where(own, g[:, 0], 0.0)[:, None]
        )
        grad[lo:hi, :n_valid] = d.mul_(inv_temp)
    return grad


# --- combine over tensor-parallel ranks, finish ------------------------------------------------


def _combine(
    row_max: torch.Tensor,
    sumexp: torch.Tensor,
    sum_pz: torch.Tensor | None,
    target_logit: torch.Tensor,
    group: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, lse, E[z] or None) from local statistics; all-reduces over ``group`` if given."""
    if group is not None:
        global_max = row_max.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        # a shard that is all padding has max -inf and sum 0: its scale exp(-inf) is 0
        scale = torch.exp(row_max - global_max)
        parts = [sumexp * scale, target_logit] + ([sum_pz * scale] if sum_pz is not None else [])
        summed = torch.stack(parts)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        row_max, sumexp, target_logit = global_max, summed[0], summed[1]
        sum_pz = summed[2] if sum_pz is not None else None
    lse = row_max + torch.log(sumexp)
    logp = target_logit - lse
    mean_z = sum_pz / sumexp if sum_pz is not None else None
    return logp, lse, mean_z


class _LogprobsFromLogits(torch.autograd.Function):
    """Saves the input logits and [T]-sized statistics only; recomputes in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Any,
        inv_temp: float,
        vocab_start: int,
        n_valid: int,
        chunk_size: int,
        with_entropy: bool,
        entropy_grad: bool,
        kernels: ModuleType | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_rows = logits.shape[0]
        if n_valid == 0:  # this tensor-parallel shard is all padding
            f32 = dict(dtype=torch.float32, device=logits.device)
            stats = (
                torch.full((n_rows,), -math.inf, **f32),
                torch.zeros(n_rows, **f32),
                torch.zeros(n_rows, **f32) if with_entropy else None,
                torch.zeros(n_rows, **f32),
            )
        elif kernels is not None:
            stats = kernels.local_stats(
                logits, targets, vocab_start, n_valid, inv_temp, with_entropy
            )
        else:
            stats = _torch_local_stats(
                logits, targets, vocab_start, n_valid, inv_temp, with_entropy, chunk_size
            )
        logp, lse, mean_z = _combine(*stats, group)
        if with_entropy:
            entropy = lse - mean_z
        else:
            entropy = logp.new_empty(0)
        keep_mean_z = mean_z if (with_entropy and entropy_grad) else None
        ctx.save_for_backward(logits, targets, lse, keep_mean_z)
        ctx.args = (inv_temp, vocab_start, n_valid, chunk_size, kernels)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        logits, targets, lse, mean_z = ctx.saved_tensors
        inv_temp, vocab_start, n_valid, chunk_size, kernels = ctx.args
        nones = (None,) * 9
        if not ctx.needs_input_grad[0] or (g_logp is None and g_entropy is None):
            return (None, *nones)
        if mean_z is None:  # entropy gradient not requested: do not pay for it
            g_entropy = None
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        g_logp = g_logp.float().contiguous()
        if g_entropy is not None:
            g_entropy = g_entropy.float().contiguous()
        if n_valid == 0:
            return (torch.zeros_like(logits), *nones)
        if kernels is not None:
            grad = kernels.logits_grad(
                logits, targets, vocab_start, n_valid, inv_temp, lse, g_logp, mean_z, g_entropy
            )
        else:
            grad = _torch_logits_grad(
                logits,
                targets,
                vocab_start,
                n_valid,
                inv_temp,
                lse,
                g_logp,
                mean_z,
                g_entropy,
                chunk_size,
            )
        return (grad, *nones)


# --- public entry point ------------------------------------------------------------------------


def _validate(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk_size: int | None,
    vocab_size: int | None,
    tp_size: int,
    kernel: str,
    check_targets: bool = True,
) -> None:
    where = "logprobs_from_logits"
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise LossInputError(
            f"{where}: logits must be a 2-D tensor [tokens, vocab_local], got {shape}; "
            "flatten batch and sequence first (logits.reshape(-1, logits.shape[-1]))"
        )
    if not logits.is_floating_point():
        raise LossInputError(f"{where}: logits must be floating point, got dtype {logits.dtype}")
    validate_targets_and_options(
        where,
        "logits",
        logits.shape[0],
        logits.shape[1],
        logits.device,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        tp_size=tp_size,
        kernel=kernel,
        check_targets=check_targets,
    )


def validate_targets_and_options(
    where: str,
    rows_name: str,
    n_rows: int,
    n_local: int,
    device: torch.device,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int | None,
    vocab_size: int | None,
    tp_size: int,
    kernel: str,
    check_targets: bool = True,
) -> None:
    """The checks shared by `logprobs_from_logits` and `logprobs_from_hidden`: targets (shape,
    dtype, device, range) and the options; ``n_local`` is this rank's vocabulary columns.
    ``check_targets=False`` leaves out the range check alone (its host sync)."""
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1:
        shape = (
            tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        )
        raise LossInputError(f"{where}: targets must be a 1-D tensor [tokens], got {shape}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise LossInputError(
            f"{where}: targets must hold integer token ids, got dtype {targets.dtype}"
        )
    if targets.shape[0] != n_rows:
        raise LossInputError(
            f"{where}: targets has {targets.shape[0]} tokens but {rows_name} has {n_rows} "
            f"rows; pass the next-token ids aligned with each {rows_name} row"
        )
    if targets.device != device:
        raise LossInputError(
            f"{where}: targets on {targets.device} but {rows_name} on {device}; "
            "move them to the same device"
        )
    if not (
        isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0
    ):
        raise LossInputError(
            f"{where}: temperature must be a finite number > 0, got {temperature!r}"
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise LossInputError(f"{where}: chunk_size must be an int >= 1 or None, got {chunk_size!r}")
    full_vocab = n_local * tp_size
    if vocab_size is not None and not (1 <= vocab_size <= full_vocab):
        raise LossInputError(
            f"{where}: vocab_size={vocab_size} must be in [1, {full_vocab}] (vocab_local "
            f"{n_local} x tensor-parallel size); it is the true vocabulary without padding"
        )
    if kernel not in _KERNELS:
        raise LossInputError(f"{where}: kernel={kernel!r} is not one of {_KERNELS}")
    n_ids = vocab_size if vocab_size is not None else full_vocab
    if not check_targets:
        return
    bad = (targets < 0) | (targets >= n_ids)
    if targets.numel() and bool(bad.any()):  # one host sync per call
        i = int(bad.nonzero()[0, 0])
        raise LossInputError(
            f"{where}: targets[{i}] = {int(targets[i])} is outside the vocabulary [0, {n_ids}); "
            "targets are global token ids (check vocab_size, padding and tensor-parallel size)"
        )


@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = ...,
    temperature: float = ...,
    vocab_size: int | None = ...,
    chunk_size: int | None = ...,
    with_entropy: Literal[False] = ...,
    entropy_grad: bool = ...,
    kernel: Kernel = ...,
    check_targets: bool = ...,
) -> torch.Tensor: ...


@overload
def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = ...,
    temperature: float = ...,
    vocab_size: int | None = ...,
    chunk_size: int | None = ...,
    with_entropy: Literal[True],
    entropy_grad: bool = ...,
    kernel: Kernel = ...,
    check_targets: bool = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def logprobs_from_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    kernel: Kernel = "auto",
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` under ``softmax(logits / temperature)``, fp32 ``[T]``.

    Args:
        logits: ``[T, V_local]``, any float dtype; vocabulary-sharded over ``tp_group`` if given
            (rank r holds ids ``[r * V_local, (r + 1) * V_local)``).
        targets: ``[T]`` global token ids in ``[0, vocab_size)``.
        tp_group: the tensor-parallel process group, or None when the logits are whole.
        temperature: the sampling temperature; divides the logits for log-probs and entropy.
        vocab_size: the true vocabulary size; columns at or beyond it (padding of the last
            shard) are left out of the softmax. Default: every column counts.
        chunk_size: token rows per chunk on the PyTorch path (default about 2**24 elements per
            chunk); the Triton kernels stream each row and need no chunks.
        with_entropy: also return the entropy of ``softmax(logits / temperature)`` per token.
        entropy_grad: when False the entropy is returned detached and backward skips its term
            (set it when the entropy coefficient is zero).
        kernel: "auto" (Triton for CUDA tensors when importable, else PyTorch), "torch" or
            "triton".
        check_targets: check that every target is in ``[0, vocab_size)`` (a ``LossInputError``
            naming the first one otherwise). The check reads the answer back from the device,
            one host sync per call; pass False only when the ids were checked on the host
            already (the RL step validates its rollout batch before any forward).

    Returns:
        ``logp`` or, with ``with_entropy``, ``(logp, entropy)``; both fp32 ``[T]``.
    """
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    _validate(logits, targets, temperature, chunk_size, vocab_size, tp_size, kernel, check_targets)

    n_local = logits.shape[1]
    full_vocab = n_local * tp_size
    vocab_start = tp_rank * n_local
    true_vocab = vocab_size if vocab_size is not None else full_vocab
    n_valid = max(0, min(n_local, true_vocab - vocab_start))

    kernels = None
    if kernel == "triton" or (kernel == "auto" and logits.is_cuda):
        kernels = _triton_kernels()
        if kernel == "triton" and (kernels is None or not logits.is_cuda):
            raise LossInputError(
                f"logprobs_from_logits: kernel='triton' needs CUDA logits and triton installed "
                f"(logits on {logits.device}, triton available: {kernels is not None}); "
                "use kernel='auto'"
            )
    if kernels is not None:
        if logits.stride(1) != 1:
            logits = logits.contiguous()  # the kernels read rows with unit column stride
        targets = targets.contiguous()
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(n_local, 1))
    group = tp_group if tp_size > 1 else None
    logp, entropy = _LogprobsFromLogits.apply(
        logits,
        targets,
        group,
        1.0 / temperature,
        vocab_start,
        n_valid,
        chunk_size,
        with_entropy,
        entropy_grad,
        kernels,
    )
    return (logp, entropy) if with_entropy else logp
