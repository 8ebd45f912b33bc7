"""Fused kernels in place of unfused megatron-core code, on CUDA without Transformer Engine:
packed RoPE (`unirl.backends.megatron.kernels.fused_rope`), the SwiGLU backward
(`unirl.backends.megatron.kernels.fused_swiglu`), the linear layers' bias in their matmul's epilogue
(`unirl.backends.megatron.kernels.linear_bias`) and, through `convert`, the models' RMSNorms
(`unirl.backends.megatron.kernels.fused_rmsnorm`).

Each `FusionPatch` names the module attribute replaced (where megatron-core's callers look it
up at call time) and the lines that call it, read in `CHECKED_VERSIONS`. A replacement has the
original's signature and result, and hands any argument it does not cover back to the original
(kept in the replacement module's ``ORIGINAL``). `install()` applies them only where CUDA and
Triton are present, megatron-core is a checked version and TE is absent (with TE, megatron runs
TE's fused RoPE when ``apply_rope_fusion`` is set) and `probe` has checked every kernel on
the GPU against what they replace; otherwise it logs why and changes nothing, so the CPU tier
keeps megatron's own code. `status` says which (megatron_throughput.py records it). The norms are
modules, not names: `convert` gives a built model's ``torch.nn.RMSNorm`` modules the Triton
forward where the patches are on.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import attrs
import torch

from unirl.backends.megatron.kernels import fused_rmsnorm, fused_rope, fused_swiglu, linear_bias

logger = logging.getLogger(__name__)

# The megatron-core versions whose source the lines below were read from.
CHECKED_VERSIONS = ("0.16.1",)


@attrs.frozen(kw_only=True)
class FusionPatch:
    """``module.name`` replaced by ``replacement``; ``originals`` is where it keeps megatron's."""

    module: str
    name: str
    replacement: Callable[..., Any]
    originals: dict[str, Callable[..., Any]]
    lines: tuple[str, ...]  # "file:line" under megatron/core that call the name


PATCHES: tuple[FusionPatch, ...] = (
    FusionPatch(
        module="megatron.core.models.common.embeddings.rope_utils",
        name="_apply_rotary_pos_emb_thd",
        replacement=fused_rope.apply_rotary_pos_emb_thd,
        originals=fused_rope.ORIGINAL,
        lines=(
            # apply_rotary_pos_emb, unfused branch with cu_seqlens (SelfAttention's q and k)
            "models/common/embeddings/rope_utils.py:303",
        ),
    ),
    FusionPatch(
        module="megatron.core.fusions.fused_bias_swiglu",
        name="swiglu_back",
        replacement=fused_swiglu.swiglu_back,
        originals=fused_swiglu.ORIGINAL,
        lines=(
            "fusions/fused_bias_swiglu.py:187",  # SwiGLUFunction.backward
            "fusions/fused_bias_swiglu.py:86",  # bias_swiglu_back (compiled; graph break)
            "fusions/fused_bias_swiglu.py:93",  # weighted_swiglu_back (compiled; graph break)
        ),
    ),
    FusionPatch(
        module="megatron.core.tensor_parallel.layers",
        name="LinearWithGradAccumulationAndAsyncCommunication",
        replacement=linear_bias.LinearWithBiasEpilogue,
        originals=linear_bias.ORIGINALS,
        # linear_with_grad_accumulation_and_async_allreduce: every trainable linear layer
        lines=("tensor_parallel/layers.py:745",),
    ),
    FusionPatch(
        module="megatron.core.tensor_parallel.layers",
        name="LinearWithFrozenWeight",
        replacement=linear_bias.FrozenLinearWithBiasEpilogue,
        originals=linear_bias.ORIGINALS,
        lines=("tensor_parallel/layers.py:440",),  # linear_with_frozen_weight
    ),
)

_state: dict[str, Any] = {"installed": None, "why": None, "probed": set()}


@attrs.frozen
class ProbeShape:
    """What a model hands the kernels: its head dim, query and key/value head counts (per TP
    rank) and dtype; Triton compiles a variant per head dim / head block / dtype, so the probe
    runs each variant the model will run."""

    head_dim: int = 16
    heads: tuple[int, ...] = (3,)
    dtype: torch.dtype = torch.bfloat16
    norm_widths: tuple[int, ...] = (40,)  # the RMSNorms' rows: hidden size (and head dim)


def probe(device: torch.device, shape: ProbeShape = ProbeShape()) -> str | None:
    """None when the kernels, compiled on ``device``, give the results of what they replace on
    small inputs of the model's head dim, head counts and dtype (RoPE forward and gradient on
    two packed sequences, a strided input as megatron's split of the fused qkv gives it: bf16
    bit for bit, fp32 within one rounding; the SwiGLU gradient within one bf16 rounding; the
    RMSNorm at each of ``norm_widths`` and the linear layers' bias epilogue no further from
    float64 than what they replace), else what differed or failed. Autograd is on whatever the caller's mode (a model built under
    ``no_grad`` or inference mode)."""
    with torch.inference_mode(False), torch.enable_grad():
        return _probe(device, shape)


def _probe(device: torch.device, shape: ProbeShape) -> str | None:
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils

    gen = torch.Generator().manual_seed(0)
    d = shape.head_dim
    cu = torch.tensor([0, 24, 64], dtype=torch.int32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(40, dtype=torch.float32), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)
    group = CPGroupShape()
    try:
        for heads in shape.heads:
            wide = torch.randn(64, heads, 2 * d, generator=gen).to(device, shape.dtype)
            g = torch.randn(64, heads, d, generator=gen).to(device, shape.dtype)
            refused = fused_rope.fused_path_refusal(wide[..., :d], freqs, False, False)
            if refused is not None:  # else megatron would be compared with itself
                return f"probe: the Triton RoPE does not take the probe's input: {refused}"
            outs = []
            for rope in (
                # megatron's own, also once the patches are on (a later model's probe)
                fused_rope.ORIGINAL.get(
                    "_apply_rotary_pos_emb_thd", rope_utils._apply_rotary_pos_emb_thd
                ),
                fused_rope.apply_rotary_pos_emb_thd,
            ):
                t = wide.clone().requires_grad_()
                out = rope(t[..., :d], cu, freqs, cp_group=group)  # strided, as k arrives
                outs.append((out, torch.autograd.grad(out, t, g)[0]))
            (want_out, want_grad), (got_out, got_grad) = outs
            if shape.dtype == torch.bfloat16:
                same = torch.equal(want_out, got_out) and torch.equal(want_grad, got_grad)
            else:
                same = torch.allclose(want_out, got_out, rtol=2e-7, atol=1e-7) and (
                    torch.allclose(want_grad, got_grad, rtol=2e-7, atol=1e-7)
                )
            if not same:
                return (
                    f"probe: the Triton RoPE differs from megatron's unfused RoPE "
                    f"(head_dim {d}, {heads} heads, {shape.dtype})"
                )
        y = torch.randn(32, 2 * 40, generator=gen).to(device, torch.bfloat16)
        dy = torch.randn(32, 40, generator=gen).to(device, torch.bfloat16)
        megatron_back = fused_swiglu.ORIGINAL.get("swiglu_back", fused_bias_swiglu.swiglu_back)
        want = megatron_back(dy, y).float()
        got = fused_swiglu.swiglu_back(dy, y).float()
        if not ((got - want).abs() <= want.abs() * 2.0**-7 + 1e-6).all():
            return (
                "probe: the Triton SwiGLU backward differs from megatron's by more than a rounding"
            )
        for width in shape.norm_widths:
            why = _probe_rms_norm(device, shape.dtype, width, gen)
            if why is not None:
                return why
        return _probe_linear_bias(device, shape.dtype, gen)
    except Exception as exc:  # a kernel that does not compile or launch here
        return f"probe failed: {type(exc).__name__}: {exc}"


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max())


def _probe_rms_norm(
    device: torch.device, dtype: torch.dtype, width: int, gen: torch.Generator
) -> str | None:
    """The Triton RMSNorm's output and both gradients no further from float64 than torch's
    RMSNorm's (twice its error, at least a rounding of the largest value, as slack)."""
    x = (3 * torch.randn(48, width, generator=gen)).to(device, dtype)
    dy = torch.randn(48, width, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(device, dtype)
    results = []
    for cls in (torch.nn.RMSNorm, fused_rmsnorm.TritonRMSNorm):
        norm = cls(width, eps=1e-6, device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        if cls is fused_rmsnorm.TritonRMSNorm:
            refused = fused_rmsnorm.fused_path_refusal(x, norm)
            if refused is not None:  # else torch would be compared with itself
                return f"probe: the Triton RMSNorm does not take the probe's input: {refused}"
        xx = x.clone().requires_grad_()
        y = norm(xx)
        results.append((y, *torch.autograd.grad(y, (xx, norm.weight), dy)))
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    want = (y64, *torch.autograd.grad(y64, (x64, w64), dy.double()))
    unit = 2.0**-7 if dtype != torch.float32 else 2.0**-22
    for name, ref, ours, exact in zip(("output", "input grad", "weight grad"), *results, want):
        slack = 2 * _max_err(ref, exact) + unit * float(exact.abs().max())
        if not _max_err(ours, exact) <= slack:
            return (
                f"probe: the Triton RMSNorm's {name} is further from float64 than torch's "
                f"({width} wide, {dtype})"
            )
    return None


def _probe_linear_bias(
    device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> str | None:
    """The linear layers with the bias in the epilogue: forward no further from float64 than
    megatron's matmul + add, and megatron's own backward giving the same gradients."""
    x = torch.randn(6, 4, 32, generator=gen).to(device, dtype)
    w = (0.2 * torch.randn(40, 32, generator=gen)).to(device, dtype)
    b = torch.randn(40, generator=gen).to(device, dtype)
    dy = torch.randn(6, 4, 40, generator=gen).to(device, dtype)
    exact = x.double() @ w.double().T + b.double()
    trainable = (False, False, False, None, 0, None)  # no fusion, no TP, no SP, no buffer
    cases = (
        (linear_bias.LinearWithBiasEpilogue, linear_bias.ORIGINAL, trainable, 3),
        (linear_bias.FrozenLinearWithBiasEpilogue, linear_bias.ORIGINAL_FROZEN, (False, None), 1),
    )
    unit = 2.0**-8 if dtype != torch.float32 else 2.0**-23
    for ours, theirs, extra, n_grads in cases:
        outs = []
        for cls in (theirs, ours):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            y = cls.apply(*leaves, *extra)
            outs.append((y, torch.autograd.grad(y, leaves[:n_grads], dy)))
        (want, want_grads), (got, got_grads) = outs
        if not _max_err(got, exact) <= _max_err(want, exact) + unit * float(exact.abs().max()):
            return f"probe: {ours.__name__}'s output is further from float64 than megatron's"
        if not all(torch.equal(a, c) for a, c in zip(want_grads, got_grads)):
            return f"probe: {ours.__name__}'s gradients differ from megatron's"
    return None


def convert(model: torch.nn.Module) -> int:
    """Where the patches are on: ``model``'s ``torch.nn.RMSNorm`` modules run the Triton
    RMSNorm (`fused_rmsnorm.convert`); returns how many were converted."""
    return fused_rmsnorm.convert(model) if _state["installed"] else 0


class CPGroupShape:
    """What megatron's THD RoPE asks of its context-parallel group (its size and this rank), for
    calls outside a real group: the probe's (one rank) and the tests'."""

    def __init__(self, size: int = 1, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def refusal() -> str | None:
    """None when `install` applies the patches here, else why not."""
    from megatron.core import package_info

    if not torch.cuda.is_available():
        return "no CUDA device"
    if fused_rope.triton is None:
        return "Triton is not installed"
    if package_info.__version__ not in CHECKED_VERSIONS:
        return (
            f"megatron-core {package_info.__version__}; unirl/backends/megatron/kernels/gpu_fusions.py "
            f"was checked against {', '.join(CHECKED_VERSIONS)}"
        )
    from unirl.backends.megatron.compat.te import te_available

    if te_available():
        return "Transformer Engine is installed (megatron uses its fused kernels)"
    return None


def install(shape: ProbeShape = ProbeShape()) -> bool:
    """Apply `PATCHES` where `refusal` allows and `probe` passes at ``shape`` (the model's);
    True when applied. Call before running a model: a later model of another shape is probed
    at its own, and a failure there takes the patches off again for the process (before that
    model runs). Why not, if not: `status`."""
    if _state["installed"] is False:
        return False
    if _state["installed"] and shape in _state["probed"]:
        return True
    why = refusal()
    if why is None:
        for patch in PATCHES:  # the probe compares against these
            patch.originals.setdefault(
                patch.name, getattr(importlib.import_module(patch.module), patch.name)
            )
        why = probe(torch.device("cuda", torch.cuda.current_device()), shape)
        if why is not None:  # a kernel that should run here and does not: say so loudly
            logger.warning("megatron Triton fusions off: %s", why)
    elif not why.startswith("no CUDA"):
        logger.info("megatron Triton fusions off: %s", why)
    if why is not None:
        for patch in PATCHES:  # off again where an earlier model's probe had put them on
            if patch.name in patch.originals:
                setattr(
                    importlib.import_module(patch.module), patch.name, patch.originals[patch.name]
                )
        _state.update(installed=False, why=why)
        return False
    _state["probed"].add(shape)
    if _state["installed"]:
        return True
    for patch in PATCHES:
        module = importlib.import_module(patch.module)
        patch.originals.setdefault(patch.name, getattr(module, patch.name))
        setattr(module, patch.name, patch.replacement)
    logger.info(
        "megatron Triton fusions on: %s (unirl.backends.megatron.kernels.gpu_fusions)",
        ", ".join(f"{p.module}.{p.name}" for p in PATCHES),
    )
    _state.update(installed=True, why=None)
    return True


def status() -> str:
    """``"on"``, ``"off: <why>"``, or ``"not installed"`` (no model built yet)."""
    if _state["installed"] is None:
        return "not installed"
    return "on" if _state["installed"] else f"off: {_state['why']}"
