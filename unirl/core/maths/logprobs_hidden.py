"""Per-token log-probs (and entropy) straight from the last hidden states and the LM head's
weight: the ``[tokens, vocab]`` logits are never held, only one vocabulary chunk of them.

With ``z = hidden @ weight.T / temperature`` and targets ``y`` this computes what
`unirl.core.maths.logprobs.logprobs_from_logits` computes from ``z`` (same formulas, same
tensor-parallel convention, same padded vocabulary), and the exact gradients for ``hidden`` and
``weight``::

    dL/dz[t, v] = g_logp[t] (onehot(y_t)[v] - p[t, v]) + g_H[t] p[t, v] (E_p[z_t] - z[t, v])
    dL/dhidden  = dz @ weight / temperature,   dL/dweight = dz.T @ hidden / temperature

Chunks run over the **vocabulary** (``chunk_size`` columns of this rank's shard at a time):

- forward: per chunk ``logits_c = hidden @ weight[c].T`` (one matmul, fp32 accumulation), its
  softmax statistics (max, sum of exps, target logit, sum of exp * z for entropy) merged into
  running per-token statistics by the online-softmax rule, then combined over the
  tensor-parallel group exactly as for logits. Saved for backward: the per-token logsumexp and,
  when the entropy's gradient is wanted, E[z]; plus the inputs, which exist anyway.
- backward: per chunk, recompute ``logits_c``, form ``dz_c`` (one tensor of the chunk's size),
  write ``dweight[c] = dz_c.T @ hidden`` (one matmul over all tokens: the weight's gradient is
  written once, with no accumulator of the vocabulary's size), and add ``dz_c @ weight[c]`` into
  one fp32 ``[T, H]`` accumulator for ``dhidden``.

Why vocabulary chunks and not token chunks: with token chunks the weight's gradient
``[V, H]`` must be accumulated over chunks (an fp32 buffer of 0.9-2.2 GiB at a 152k vocabulary,
or bf16 rounding at every chunk); with vocabulary chunks the only accumulator is ``[T, H]``
fp32, ``2H / V`` of the bf16 logits' bytes (1/21 at H = 3,584, V = 151,936).

FLOPs: four ``T x V x H`` matmuls against three for head matmul + log-prob kernel (forward,
recompute, two gradients). The fourth cannot be traded away: the upstream gradients ``g_logp``,
``g_H`` are per token and unknown until the loss runs, and ``dweight`` contracts them over
tokens, so no part of ``dweight`` can be formed in the forward; the part of ``dhidden`` that does
not depend on them (``(onehot - p) @ W`` and, for entropy, ``(p (E[z] - z)) @ W``) could be, but
that only moves a matmul from backward to forward (two with entropy) and saves ``[T, H]`` fp32
tensors. Forward-only passes (old-policy and reference log-probs) cost one matmul, as before.
When the loss is separable over tokens its per-token gradient IS known in the forward, and
`unirl.core.maths.head_loss` takes the loss into token chunks with three matmuls.

Tensor parallel (Megatron's vocabulary-parallel output layer): ``weight`` is this rank's shard
``[V_local, H]`` holding ids ``[r * V_local, (r + 1) * V_local)``; rows at or beyond
``vocab_size`` (the last shard's padding) are skipped, so their gradient is 0. ``hidden`` is
replicated over the group, and its returned gradient is the full one: the per-shard
contributions are all-reduced (SUM) in backward, as Megatron's column-parallel layer does for its
input.

On CUDA with Triton the per-chunk statistics and gradient are the kernels of
`unirl.core.maths.kernels.logprobs_triton`; cuBLAS does the matmuls, the chunk's logits in fp32
(bf16 inputs, fp32 accumulation and output: finer than the head's bf16 logits), ``dz`` in the
inputs' dtype for the two gradient matmuls. Otherwise the chunked PyTorch path, all fp32, which
is also the reference.
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType
from typing import Any, Literal, overload

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import LossInputError
from unirl.core.maths.logprobs import (
    Kernel,
    _combine,
    _torch_local_stats,
    _torch_logits_grad,
    _triton_kernels,
    validate_targets_and_options,
)

logger = logging.getLogger(__name__)

# Per chunk the CUDA path holds the chunk's fp32 logits and its gradient dz in the inputs' dtype
# (6 bytes per element in bf16): 256 MiB of them, beside the [T, H] fp32 accumulator. At 16k
# tokens that is ~2.7k columns (0.34-0.47 GiB with the accumulator at H = 1,536-3,584, under 1/8
# of the 4.6 GiB bf16 logits).
_CUDA_CHUNK_BYTES = 1 << 28
# Never fewer columns on CUDA: each chunk's dz @ weight[c] reads and writes the [T, H] fp32
# accumulator, 4 / columns bytes per FLOP; at 2,048 columns that is 0.002, under the H200's
# ~0.005 bytes/FLOP balance, so the matmul stays mostly compute-bound (at 65k tokens the chunk
# then holds 0.75 GiB, beside 18.5 GiB of logits).
_CUDA_MIN_COLUMNS = 2048
# The CPU's fp32 path makes a few temporaries of the chunk's size: 2**24 elements, as in
# logprobs_from_logits.
_CPU_CHUNK_ELEMENTS = 1 << 24
# Chunk widths are whole multiples of this many columns (tensor-core tiles for the matmuls).
_CHUNK_ALIGN = 128


def default_chunk_size(n_tokens: int, device: torch.device, dtype: torch.dtype) -> int:
    """Vocabulary columns per chunk for ``n_tokens`` rows of ``dtype`` on ``device``."""
    rows = max(n_tokens, 1)
    if device.type == "cuda":
        per_element = 4 + dtype.itemsize  # fp32 chunk logits + dz
        cols = max(_CUDA_MIN_COLUMNS, _CUDA_CHUNK_BYTES // (rows * per_element))
    else:
        cols = _CPU_CHUNK_ELEMENTS // rows
    return max(_CHUNK_ALIGN, cols // _CHUNK_ALIGN * _CHUNK_ALIGN)


@functools.cache
def _fp32_addmm_works(device_type: str) -> bool:
    """Whether ``addmm(..., out_dtype=float32)`` (bf16 x bf16 accumulated into fp32 by cuBLAS)
    runs here; torch has it on CUDA only."""
    if device_type != "cuda":
        return False
    try:  # shaped as used: acc [T, H] += dz [T, c] @ weight[c] [c, H], twice
        a = torch.ones(4, 6, device=device_type, dtype=torch.bfloat16)
        b = torch.ones(6, 8, device=device_type, dtype=torch.bfloat16)
        acc = torch.zeros(4, 8, device=device_type, dtype=torch.float32)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return bool(acc[0, 0] == 12)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        logger.warning(
            "torch.addmm(out_dtype=float32) unavailable (%s): the fused head sums the hidden "
            "states' gradient in fp32 from per-chunk products rounded to the inputs' dtype",
            err,
        )
        return False


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32; ``a``, ``b`` in the compute dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif _fp32_addmm_works(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # the product rounded once to a.dtype, the sum over chunks in fp32
        acc.add_(a @ b)


@functools.cache
def _fp32_out_mm_works(device_type: str) -> bool:
    """Whether ``mm(..., out_dtype=float32)`` (bf16 inputs, fp32 output) runs here."""
    if device_type != "cuda":
        return False
    try:  # shaped as used: hidden [T, H] @ weight[c].T
        a = torch.ones(4, 8, device=device_type, dtype=torch.bfloat16)
        b = torch.ones(6, 8, device=device_type, dtype=torch.bfloat16)
        out = torch.mm(a, b.T, out_dtype=torch.float32)
        return out.dtype == torch.float32 and bool(out[0, 0] == 8)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        logger.warning(
            "torch.mm(out_dtype=float32) unavailable (%s): the fused head's chunk logits are "
            "rounded to the inputs' dtype, as the head's own matmul rounds them",
            err,
        )
        return False


class _Chunks:
    """The vocabulary chunks of one call and how to compute each chunk's logits."""

    def __init__(
        self, hidden: torch.Tensor, weight: torch.Tensor, n_valid: int, chunk: int, fp32: bool
    ) -> None:
        self.bounds = [(lo, min(lo + chunk, n_valid)) for lo in range(0, n_valid, chunk)]
        # the PyTorch path computes in fp32 (no copy when the inputs are fp32 already); the
        # kernels' path keeps the gradient matmuls in the inputs' dtype
        self.hidden = hidden.float() if fp32 else hidden
        self.weight = weight
        self.fp32 = fp32

    def weight_rows(self, lo: int, hi: int) -> torch.Tensor:
        w = self.weight[lo:hi]
        return w.float() if self.fp32 else w

    def logits(self, lo: int, hi: int) -> torch.Tensor:
        """``hidden @ weight[lo:hi].T`` (unscaled) in fp32, ``[T, hi - lo]``, contiguous: the
        matmul accumulates in fp32 and its output is not rounded to bf16 (the head's own matmul
        rounds the logits to the inputs' dtype; a chunk can afford fp32)."""
        h, w = self.hidden, self.weight_rows(lo, hi)
        if h.dtype == torch.float32:
            return h @ w.T
        if h.is_cuda:
            if _fp32_out_mm_works(h.device.type):
                return torch.mm(h, w.T, out_dtype=torch.float32)
            return h @ w.T  # an older torch: logits rounded as the head's matmul rounds them
        return h.float() @ w.float().T  # the kernels on the CPU (Triton's interpreter)


def _merge(
    run: list[torch.Tensor | None], part: tuple[torch.Tensor, torch.Tensor, Any, torch.Tensor]
) -> None:
    """Fold one chunk's (max, sum-exp, sum exp*z, target logit) into the running ones (online
    softmax: rescale both sums to the new max)."""
    m, s, w, tgt = run
    m_c, s_c, w_c, tgt_c = part
    m_new = torch.maximum(m, m_c)
    a, b = torch.exp(m - m_new), torch.exp(m_c - m_new)  # the first chunk: exp(-inf) = 0
    run[0] = m_new
    run[1] = s.mul_(a).add_(s_c * b)
    if w is not None:
        run[2] = w.mul_(a).add_(w_c * b)
    run[3] = tgt.add_(tgt_c)  # 0 where the target is not in this chunk


class _LogprobsFromHidden(torch.autograd.Function):
    """Saves the inputs and [T]-sized statistics only; recomputes chunk logits in backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
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
        n_rows = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        run: list[torch.Tensor | None] = [
            torch.full((n_rows,), -math.inf, **f32),
            torch.zeros(n_rows, **f32),
            torch.zeros(n_rows, **f32) if with_entropy else None,
            torch.zeros(n_rows, **f32),
        ]
        chunks = _Chunks(hidden, weight, n_valid, chunk_size, fp32=kernels is None)
        rows = max(n_rows, 1)  # the PyTorch path's row chunk: the whole (bounded) chunk
        for lo, hi in chunks.bounds:
            logits = chunks.logits(lo, hi)
            if kernels is not None:
                part = kernels.local_stats(
                    logits, targets, vocab_start + lo, hi - lo, inv_temp, with_entropy
                )
            else:
                part = _torch_local_stats(
                    logits, targets, vocab_start + lo, hi - lo, inv_temp, with_entropy, rows
                )
            del logits
            _merge(run, part)
        logp, lse, mean_z = _combine(*run, group)
        entropy = lse - mean_z if with_entropy else logp.new_empty(0)
        keep_mean_z = mean_z if (with_entropy and entropy_grad) else None
        ctx.save_for_backward(hidden, weight, targets, lse, keep_mean_z)
        ctx.args = (group, inv_temp, vocab_start, n_valid, chunk_size, kernels)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(
        ctx: Any, g_logp: torch.Tensor | None, g_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        group, inv_temp, vocab_start, n_valid, chunk_size, kernels = ctx.args
        nones = (None,) * 9
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (want_h or want_w) or (g_logp is None and g_entropy is None):
            return (None, None, *nones)
        if mean_z is None:  # entropy gradient not requested: do not pay for it
            g_entropy = None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        if g_entropy is not None:
            g_entropy = g_entropy.float().contiguous()
        n_rows = hidden.shape[0]
        grad_h32 = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        )
        grad_w = None
        if want_w:  # every valid row is written once below; padding rows get 0
            grad_w = torch.empty_like(weight)
            grad_w[n_valid:] = 0
        chunks = _Chunks(hidden, weight, n_valid, chunk_size, fp32=kernels is None)
        for lo, hi in chunks.bounds:
            logits = chunks.logits(lo, hi)
            args = (targets, vocab_start + lo, hi - lo, inv_temp, lse, g_logp, mean_z, g_entropy)
            if kernels is not None:  # dz in the inputs' dtype, for the gradient matmuls
                dz = kernels.logits_grad(logits, *args, out_dtype=hidden.dtype)
            else:
                dz = _torch_logits_grad(logits, *args, max(n_rows, 1))
            del logits
            if grad_w is not None:
                if kernels is not None:
                    torch.mm(dz.T, chunks.hidden, out=grad_w[lo:hi])
                else:
                    grad_w[lo:hi] = dz.T @ chunks.hidden
            if grad_h32 is not None:
                _accumulate_mm(grad_h32, dz, chunks.weight_rows(lo, hi))
            del dz
        grad_h = None
        if grad_h32 is not None:
            if group is not None:  # hidden is replicated: sum every shard's contribution
                dist.all_reduce(grad_h32, group=group)
            grad_h = grad_h32.to(hidden.dtype)
        return (grad_h, grad_w, *nones)


def validate_hidden_inputs(
    where: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int | None,
    vocab_size: int | None,
    tp_size: int,
    kernel: str,
) -> None:
    """The checks of `logprobs_from_hidden` and `unirl.core.maths.head_loss.head_loss` (``where``
    names the caller in the messages): hidden, weight, targets and the options."""
    for name, t, shape in (
        ("hidden", hidden, "[tokens, hidden]"),
        ("weight", weight, "[vocab_local, hidden]"),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise LossInputError(
                f"{where}: {name} must be a 2-D tensor {shape}, got {got}; flatten batch and "
                "sequence first (hidden.reshape(-1, hidden.shape[-1]))"
            )
        if not t.is_floating_point():
            raise LossInputError(f"{where}: {name} must be floating point, got dtype {t.dtype}")
    if hidden.shape[1] != weight.shape[1]:
        raise LossInputError(
            f"{where}: hidden has {hidden.shape[1]} features but weight has {weight.shape[1]} "
            "columns; pass the LM head's weight [vocab_local, hidden] (not transposed)"
        )
    if hidden.dtype != weight.dtype:
        raise LossInputError(
            f"{where}: hidden is {hidden.dtype} but weight is {weight.dtype}; cast the hidden "
            "states to the head's dtype (hidden.to(weight.dtype)) as the head's matmul would"
        )
    if hidden.device != weight.device:
        raise LossInputError(
            f"{where}: hidden on {hidden.device} but weight on {weight.device}; move them to "
            "the same device"
        )
    validate_targets_and_options(
        where,
        "hidden",
        hidden.shape[0],
        weight.shape[0],
        hidden.device,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        tp_size=tp_size,
        kernel=kernel,
    )


@attrs.frozen(eq=False)
class HiddenInputs:
    """The checked inputs of a head pass (`prepare_hidden_inputs`): the tensors (contiguous for
    the Triton kernels), this rank's vocabulary shard and the kernels to use."""

    hidden: torch.Tensor
    targets: torch.Tensor
    # the tensor-parallel group, or None when the vocabulary is whole (one rank)
    group: Any
    # the first global token id of this rank's shard, and how many of its rows are real
    # (not padding beyond the true vocabulary)
    vocab_start: int
    n_valid: int
    kernels: ModuleType | None


def prepare_hidden_inputs(
    where: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any,
    temperature: float,
    chunk_size: int | None,
    vocab_size: int | None,
    kernel: Kernel,
) -> HiddenInputs:
    """The common set-up of `logprobs_from_hidden` and `unirl.core.maths.head_loss.head_loss`
    (``where`` names the caller in the messages): the checks, this rank's vocabulary shard, and
    the kernels: Triton for CUDA tensors under "auto" when importable, refused loudly when
    "triton" is asked for and cannot run."""
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    validate_hidden_inputs(
        where,
        hidden,
        weight,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        tp_size=tp_size,
        kernel=kernel,
    )
    n_local = weight.shape[0]
    vocab_start = tp_rank * n_local
    true_vocab = vocab_size if vocab_size is not None else n_local * tp_size
    n_valid = max(0, min(n_local, true_vocab - vocab_start))
    kernels = None
    if kernel == "triton" or (kernel == "auto" and hidden.is_cuda):
        kernels = _triton_kernels()
        if kernel == "triton" and (kernels is None or not hidden.is_cuda):
            raise LossInputError(
                f"{where}: kernel='triton' needs CUDA tensors and triton installed "
                f"(hidden on {hidden.device}, triton available: {kernels is not None}); "
                "use kernel='auto'"
            )
    if kernels is not None:
        hidden, targets = hidden.contiguous(), targets.contiguous()
    group = tp_group if tp_size > 1 else None
    return HiddenInputs(hidden, targets, group, vocab_start, n_valid, kernels)


@overload
def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = ...,
    temperature: float = ...,
    vocab_size: int | None = ...,
    with_entropy: Literal[False] = ...,
    entropy_grad: bool = ...,
    chunk_size: int | None = ...,
    kernel: Kernel = ...,
) -> torch.Tensor: ...


@overload
def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = ...,
    temperature: float = ...,
    vocab_size: int | None = ...,
    with_entropy: Literal[True],
    entropy_grad: bool = ...,
    chunk_size: int | None = ...,
    kernel: Kernel = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: int | None = None,
    kernel: Kernel = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` under ``softmax(hidden @ weight.T / temperature)``, fp32 ``[T]``,
    without the ``[T, V]`` logits (see the module docstring).

    Args:
        hidden: ``[T, H]``, the final hidden states (after the last norm), in the head's dtype;
            the same on every rank of ``tp_group``.
        weight: ``[V_local, H]``, the LM head's weight (the embedding when tied); this rank's
            vocabulary shard under ``tp_group``.
        targets: ``[T]`` global token ids in ``[0, vocab_size)``.
        tp_group: the tensor-parallel process group, or None when the vocabulary is whole.
        temperature: divides the logits for log-probs and entropy alike.
        vocab_size: the true vocabulary; weight rows at or beyond it (padding) are left out.
        with_entropy: also return the entropy per token.
        entropy_grad: when False the entropy is returned detached and backward skips its term.
        chunk_size: vocabulary columns per chunk (default `default_chunk_size`: 256 MiB of
            chunk logits and gradient on CUDA, at least 2,048 columns; 2**24 elements on the CPU).
        kernel: "auto" (Triton for CUDA tensors when importable, else PyTorch), "torch" or
            "triton".

    Returns:
        ``logp`` or, with ``with_entropy``, ``(logp, entropy)``; both fp32 ``[T]``.
    """
    inputs = prepare_hidden_inputs(
        "logprobs_from_hidden",
        hidden,
        weight,
        targets,
        tp_group=tp_group,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        kernel=kernel,
    )
    hidden = inputs.hidden
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], hidden.device, hidden.dtype)
    logp, entropy = _LogprobsFromHidden.apply(
        hidden,
        weight,
        inputs.targets,
        inputs.group,
        1.0 / temperature,
        inputs.vocab_start,
        inputs.n_valid,
        chunk_size,
        with_entropy,
        entropy_grad,
        inputs.kernels,
    )
    return (logp, entropy) if with_entropy else logp
