"""Causal attention over long sequences on cuDNN's fused kernel, shared by every backend's packed
attention (Megatron's `kernels.varlen_attention`, the Hugging Face backends' `hf.packed`).

Why: on an H100 (torch 2.11, cuDNN 9.19) at Qwen3-4B's heads (32 query, 8 key/value, head dim
128, bf16, causal), forward + backward of one sequence runs at 580 TFLOP/s on cuDNN through
``scaled_dot_product_attention`` with ``enable_gqa``, against 320 TFLOP/s on flash attention 2
(``varlen_attn``, torch's flash kernel): 13.3 ms against 24.0 ms at 16,384 tokens, 226 ms
against 378 ms at 65,536. At 64k tokens attention is about 70% of a 4B model's FLOPs, so the
kernel decides the step (`benchmarks/attention_kernels.py`, its results in
``benchmarks/results/attention_kernels/``). Flash's varlen kernel stays the path for packs of
many short sequences (one call for the whole pack, no host sync); cuDNN takes a pack when its
longest sequence is long (`use_cudnn`), one call per sequence.

**On by default** (``UNIRL_CUDNN_ATTENTION=0`` in the environment turns it off). What ran on an
H100 (`benchmarks/results/megatron_throughput/`, the ``reuse`` / ``reuse-cudnn`` A/B in one
process): a Qwen3-4B LoRA step at 16,384 tokens 10,943 -> 14,121 tokens/s, the 18-layer full step
at 65,536 tokens 27.2% -> 43.3% MFU, the loss and gradient norm alike (0.230459 / 0.230464); this
path's test on one- and many-sequence packs (Megatron's and the Hugging Face attention against an
fp64 reference). torch itself made cuDNN its default H100 attention in 2.5 and took that back in
2.5.1 (wrong results on some builds), so cuDNN is used only after `_probe` has seen it give the
reference's numbers on this device and dtype (odd lengths and grouped heads, forward and
backward); a sequence it has no kernel for runs on the caller's flash path.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# A pack goes to cuDNN when its longest sequence has at least this many tokens: there one
# call per sequence (and the host sync for the bounds) is noise beside the attention itself.
MIN_LONGEST = 8192
_ENV = "UNIRL_CUDNN_ATTENTION"
_WORKS: dict[tuple[int, torch.dtype, int], bool] = {}  # (device, dtype, head dim): probed
_REFUSED: set[int] = set()  # lengths cuDNN had no kernel for (logged once each)


_OFF = ("0", "false", "off", "no")


def enabled() -> bool:
    """Whether long packs may use cuDNN (``UNIRL_CUDNN_ATTENTION=0``, ``false``, ``off`` or
    ``no``: never)."""
    return os.environ.get(_ENV, "1").strip().lower() not in _OFF


def plan_note(max_seq_len: int, dtype: str, cp: int = 1) -> str:
    """What a run whose sequences reach ``max_seq_len`` tokens attends with on a GPU (for
    ``unirl check``; the probe's answer is known only on the GPU). ``dtype``: the model's
    (``fp32`` runs neither kernel); ``cp``: context-parallel ranks (their ring takes flash)."""
    if dtype not in ("bf16", "fp16"):
        return (
            f"on a GPU SDPA without flash or cuDNN (model.dtype {dtype}: both kernels take "
            "bf16 / fp16 only)"
        )
    if not enabled():
        return f"flash varlen for every pack on a GPU ({_ENV}={os.environ.get(_ENV)})"
    if cp > 1:
        return f"flash varlen for every pack on a GPU (context parallel, cp {cp}, runs on it)"
    if max_seq_len < MIN_LONGEST:
        return (
            f"flash varlen for every pack on a GPU: no sequence reaches {MIN_LONGEST:,} tokens "
            f"(model.max_seq_len {max_seq_len:,}), where cuDNN would take over"
        )
    return (
        f"on a GPU a pack whose longest sequence has {MIN_LONGEST:,} tokens or more (model."
        f"max_seq_len {max_seq_len:,} allows them) on cuDNN through SDPA, one call per sequence, "
        "once its probe has matched an fp32 reference on the card (else flash varlen); shorter "
        f"packs on flash varlen; {_ENV}=0 keeps every pack on flash"
    )


def use_cudnn(q: torch.Tensor, longest: int) -> bool:
    """Whether a pack whose longest sequence has ``longest`` tokens runs on cuDNN here."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)) or longest < MIN_LONGEST:
        return False
    if not enabled():
        return False
    return probed(q.device, q.dtype, q.shape[-1])


def probed(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cuDNN gave the reference's numbers at ``head_dim`` on ``device`` in ``dtype``,
    probing once per key. Callers that run attention under a selective activation checkpoint
    call it before entering one (`unirl.backends.kept_attention`): a probe inside would put its
    own attention outputs in the checkpoint's cache, which the recompute (no probe) would then
    hand to the layer's real attention."""
    key = (device.index or 0, dtype, head_dim)
    if key not in _WORKS:
        why = _probe(device, dtype, head_dim=head_dim)
        if why is not None:
            logger.info("attention stays on flash attention (cuDNN: %s)", why)
        else:
            logger.info("attention of sequences >= %d tokens on cuDNN", MIN_LONGEST)
        _WORKS[key] = why is None
    return _WORKS[key]


def probe_ahead(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Run the probe now if a long pack could take cuDNN here (CUDA, bf16 / fp16, turned on)."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and enabled():
        probed(device, dtype, head_dim)


def cudnn_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence: ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, Hq, D]``, causal; query
    head ``h`` reads key/value head ``h // (Hq / Hkv)`` (Megatron's and transformers' grouping)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw: dict[str, Any] = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(
            q.contiguous().transpose(0, 1)[None],  # Megatron's q is a view of the fused qkv
            k.contiguous().transpose(0, 1)[None],
            v.contiguous().transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            **kw,
        )
    return out[0].transpose(0, 1)


def cudnn_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[int],
    scale: float,
    fallback: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Causal attention within each sequence of a pack (``bounds``: the host copy of
    ``cu_seqlens``), one cuDNN call per sequence; a sequence cuDNN has no kernel for (seen on an
    H100, torch 2.11, in a pack of 1-, 3-, 8- and 37-token sequences) runs ``fallback`` (the
    caller's flash path on that one sequence)."""
    if len(bounds) == 2:
        return _one(q, k, v, scale, fallback)
    pieces = [
        _one(q[a:b], k[a:b], v[a:b], scale, fallback)
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
    return torch.cat(pieces)


def _one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    fallback: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    try:
        return cudnn_causal(q, k, v, scale)
    except RuntimeError as exc:  # SDPA's "No available kernel": refused before any launch
        if "No available kernel" not in str(exc):
            raise
        if q.shape[0] not in _REFUSED:
            _REFUSED.add(q.shape[0])
            logger.info("cuDNN attention refused a %d-token sequence: flash runs it", q.shape[0])
        return fallback(q, k, v)


def _probe(device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> str | None:
    """None when cuDNN's output and gradients match an fp32 causal reference on odd lengths with
    grouped heads of the model's ``head_dim``, else why not."""
    try:
        # the first long pack probes, often inside an activation checkpoint's forward: the
        # identity hooks keep the probe's tensors out of what the checkpoint saves (else its
        # recompute, which does not probe, finds fewer and raises; seen on FSDP2 on an H100)
        with (
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(_detached, _same),
        ):
            gen = torch.Generator().manual_seed(0)
            for length in (19, 333):
                q, k, v, g = (
                    torch.randn(length, h, head_dim, generator=gen).to(device) for h in (4, 2, 2, 4)
                )
                got = _out_and_grads(q, k, v, g, dtype, cudnn=True)
                ref = _out_and_grads(q, k, v, g, torch.float32, cudnn=False)
                for a, b in zip(got, ref, strict=True):
                    if a.shape != b.shape or not torch.allclose(a.float(), b, atol=3e-2, rtol=3e-2):
                        return f"differs from the fp32 reference at length {length}"
    except Exception as exc:  # a torch / cuDNN build without the kernel or without grouped heads
        return f"{type(exc).__name__}: {exc}"
    return None


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # the saved tensor itself would be a reference cycle (torch's docs)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _out_and_grads(q, k, v, g, dtype: torch.dtype, *, cudnn: bool) -> list[torch.Tensor]:
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    if cudnn:
        out = cudnn_causal(*leaves, scale=q.shape[-1] ** -0.5)
    else:
        rep = q.shape[1] // k.shape[1]
        qq, kk, vv = (
            t.transpose(0, 1) if i == 0 else t.repeat_interleave(rep, dim=1).transpose(0, 1)
            for i, t in enumerate(leaves)
        )
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=q.shape[-1] ** -0.5)
        out = out.transpose(0, 1)
    grads = torch.autograd.grad(out, leaves, g.to(dtype))
    return [out.detach(), *(x.detach() for x in grads)]
