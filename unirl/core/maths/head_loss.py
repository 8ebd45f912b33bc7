"""The loss inside the fused head: from the final hidden states and the (vocabulary-sharded) LM
head weight to the loss, its metrics and the exact gradients of both, in THREE head-sized matmuls
and without the ``[T, V]`` logits — for losses that are a sum over tokens of a function of each
token's own log-prob and entropy (`unirl.core.maths.losses.separable`).

`unirl.core.maths.logprobs_hidden` needs four matmuls because the upstream gradient of each
token's log-prob is only known after the loss. For a separable loss it is known as soon as the
token's log-prob is: ``dL/dlogp_t = f_t'(logp_t, H_t)``. So the chunks run over TOKENS, each with
the whole vocabulary (Liger's FusedLinearCrossEntropy / GRPO design), and per chunk ``c``::

    logits_c = hidden[c] @ weight.T            matmul 1 (one [C, V_local] buffer, reused)
    logp_c, H_c from the softmax statistics     (over the tensor-parallel group: MAX + SUM)
    g_logp_c, g_H_c = the loss's gradient       (below)
    dz_c = g_logp (onehot - p) + g_H p (E[z] - z), / temperature, written over logits_c
    dhidden[c] = dz_c @ weight                  matmul 2 (each row written once)
    dweight   += dz_c.T @ hidden[c]             matmul 3 (accumulated over token chunks)

and backward only multiplies the stored gradients by the scalar upstream gradient (the backend's
loss scale). The per-token gradient comes from the caller's loss itself, with no per-loss code:
the loss is called on the ``[T]`` log-probs with this chunk's values filled in (tokens of later
chunks hold 0, earlier ones their values) as a leaf, and autograd's gradient at the chunk's tokens
is exactly ``f_t'`` there because no token's term depends on another's log-prob. The metrics and
the loss value come from one last call on the complete detached log-probs.

Kernels per chunk on CUDA with a whole vocabulary: the logits matmul, one statistics kernel that
also writes the chunk's log-probs, entropy, ``lse`` and ``E[z]`` (`finished_stats`: nothing runs
between it and the loss), the loss's own small ops, one kernel for ``dz`` (in place) and the two
gradient matmuls; ``overlap`` can move those to a side stream (`head_loss`).

Precision: on CUDA the chunk logits are the head's bf16 (cuBLAS, fp32 accumulation, one rounding
as the head's own matmul rounds them), the softmax statistics and ``dz`` come from the Triton
kernels of `unirl.core.maths.kernels.logprobs_triton` (``dz`` overwrites the chunk's logits),
``dhidden`` is one rounding of an fp32-accumulated product, and ``dweight`` is summed over the
token chunks in the weight's dtype (each cuBLAS ``addmm`` accumulates in fp32 and rounds once: one
rounding per chunk, as in Liger; ``dweight_fp32`` sums in fp32 instead, for twice the weight's
bytes). Against fp64 the gradients' error is that of the plain logits path (head matmul + kernel
+ autograd), which rounds the logits and their gradient to bf16 alike: on the GPU test's input
with an entropy term both have ~3.3e-2 relative error in ``dhidden`` and ``dweight``. On the
CPU a plain chunked PyTorch path computes in fp32 (fp64 for fp64 inputs) with fp32 accumulators.

Memory beyond the inputs: the two gradients (which every method returns) plus one chunk of logits,
``chunk_size x V_local`` in the inputs' dtype (`default_token_chunk`).

Tensor parallel (Megatron's vocabulary-parallel output layer): as `logprobs_from_hidden`, rank r
holds ids ``[r V_local, (r + 1) V_local)``, rows at or beyond ``vocab_size`` are padding (gradient
0), ``hidden`` is replicated and its gradient is the sum over the shards (one all-reduce at the
end); each chunk all-reduces its ``[C]`` statistics. Every rank calls the loss on the same
log-probs, so the ranks agree on every gradient.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

from unirl.core.errors import LossInputError
from unirl.core.maths.logprobs import Kernel, _combine
from unirl.core.maths.logprobs_hidden import (
    _accumulate_mm,
    _fp32_out_mm_works,
    prepare_hidden_inputs,
)
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.separable import separability
from unirl.core.maths.losses.settings import LossSettings

logger = logging.getLogger(__name__)

# loss(logprobs [T], entropy [T] or None) -> (this microbatch's loss, metrics): the backend's
# `LossFn` with its microbatch bound. Must be separable over tokens (`choose_head_path`).
TokenLoss = Callable[
    [torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, Mapping[str, Metric]]
]

# How the gradient matmuls overlap the rest (`head_loss`'s ``overlap``), on CUDA with both gradients wanted: "none"; "dw" runs each chunk's
# weight-gradient addmm on a side stream beside its hidden-gradient matmul (no extra memory);
# "pipeline" runs both gradient matmuls of a chunk on the side stream while the next chunk's
# logits are made in a second buffer (twice the chunk's memory).
Overlap = Literal["none", "dw", "pipeline"]
_OVERLAPS = ("none", "dw", "pipeline")

# The CUDA chunk holds ``rows x V_local`` logits in the inputs' dtype; this bounds its bytes. At
# vocabulary 151,936 in bf16: 1,024 rows, 0.29 GiB. Fewer rows make more, smaller matmuls and more
# loss calls; below ~512 rows the weight-gradient addmm reads and writes the whole [V, H] gradient
# per chunk for too few FLOPs (benchmarks/fused_head.py --head-loss-chunks measures the trade-off).
_CUDA_CHUNK_BYTES = 1 << 29
_CUDA_MIN_ROWS = 128
# Each chunk's weight-gradient addmm also reads and writes the whole [V, H] gradient: 2 / rows
# bytes per FLOP, paid once per chunk. For long microbatches the chunk grows to 1/16 of the
# tokens (at most this many bytes), so that traffic stays below ~1/8 of the matmul time while the
# chunk stays 1/16 of the [T, V] logits the plain head holds. At 65,536 tokens x 151,936: 4,096
# rows, 1.16 GiB (benchmarks/fused_head.py --head-loss-chunks measures the trade-off).
_CUDA_MAX_CHUNK_BYTES = 1 << 31
_CUDA_TOKEN_FRACTION = 16
# The CPU path makes a few temporaries of the chunk's size: 2**24 elements, as logprobs_from_hidden.
_CPU_CHUNK_ELEMENTS = 1 << 24


def default_token_chunk(
    n_local: int, device: torch.device, dtype: torch.dtype, n_tokens: int = 0
) -> int:
    """Token rows per chunk for ``n_local`` vocabulary rows of ``dtype`` on ``device`` and a
    microbatch of ``n_tokens``; it depends only on the shard's shape and the token count, so
    every tensor-parallel rank runs the same chunks."""
    cols = max(n_local, 1)
    if device.type == "cuda":
        rows = max(_CUDA_MIN_ROWS, _CUDA_CHUNK_BYTES // (cols * dtype.itemsize))
        cap = max(rows, _CUDA_MAX_CHUNK_BYTES // (cols * dtype.itemsize))
        rows = max(rows, min(cap, n_tokens // _CUDA_TOKEN_FRACTION))
        return 1 << (rows.bit_length() - 1)  # a power of two: whole tensor-core tiles
    return max(1, _CPU_CHUNK_ELEMENTS // cols)


@attrs.frozen
class HeadPath:
    """Which fused-head path a loss configuration takes, and why (printed by `unirl check`)."""

    loss_in_head: bool  # True: `head_loss` (3 matmuls); False: `logprobs_from_hidden` + the loss
    reason: str


def choose_head_path(settings: LossSettings) -> HeadPath:
    """The fused head's path for ``settings``: the loss inside the head when it is separable over
    tokens, else log-probs from the head (logits recomputed in backward) and the loss after."""
    sep = separability(settings)
    if sep.separable:
        return HeadPath(True, f"loss inside the fused head (3 head matmuls): {sep.reason}")
    return HeadPath(False, f"fused head log-probs, then the loss (4 head matmuls): {sep.reason}")


@attrs.frozen(kw_only=True, eq=False)
class HeadLossOutput:
    """``loss``: the scalar loss, autograd-connected to ``hidden`` and ``weight`` (and to whatever
    else the loss reads); ``metrics``: the loss's metrics on the complete log-probs;
    ``logprobs`` / ``entropy``: detached fp32 ``[T]`` (entropy None unless asked for)."""

    loss: torch.Tensor
    metrics: Mapping[str, Metric]
    logprobs: torch.Tensor
    entropy: torch.Tensor | None


class _Grads:
    """The gradients made in the forward, handed once to backward (not autograd inputs)."""

    def __init__(self, hidden: torch.Tensor | None, weight: torch.Tensor | None) -> None:
        self.hidden, self.weight = hidden, weight


class _AttachGrads(torch.autograd.Function):
    """Returns 0, with the stored gradients of ``hidden`` and ``weight`` as its backward (scaled
    by the upstream gradient); added to the loss value to connect it to both."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, grads: _Grads
    ) -> torch.Tensor:
        ctx.grads = grads
        ctx.hidden_dtype = hidden.dtype
        return torch.zeros((), dtype=torch.float32, device=hidden.device)

    @staticmethod
    def backward(
        ctx: Any, g: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "head_loss: backward ran twice through the same loss; its gradients are made in "
                "the forward and handed over once (call head_loss again, or do not retain_graph)"
            )
        # one multi-tensor launch over both gradients: a per-tensor ``mul_`` by the 0-dim CUDA
        # tensor ``g`` runs torch's broadcasting (unvectorised) kernel, 1.1 ms over the
        # 16,384 x 1,536 head's two gradients on an H200, several times the bandwidth floor
        made = [t for t in (grads.hidden, grads.weight) if t is not None]
        if made:
            torch._foreach_mul_(made, g)
        gh = None if grads.hidden is None else grads.hidden.to(ctx.hidden_dtype)
        return gh, grads.weight, None


def _loss_grads(
    loss: TokenLoss, logp: torch.Tensor, entropy: torch.Tensor | None, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dL/dlogp, dL/dH)`` at every token from one call of the loss on leaves holding the
    log-probs computed so far: exact at the tokens computed last, for a separable loss."""
    x = logp.detach().requires_grad_(True)
    e = None if entropy is None else entropy.detach().requires_grad_(entropy_grad)
    wrt = [x] + ([e] if e is not None and entropy_grad else [])
    with torch.enable_grad():
        value, _ = loss(x, e)
    if not value.requires_grad:  # e.g. a loss whose every token is masked
        grads: tuple[torch.Tensor | None, ...] = (None,) * len(wrt)
    else:
        grads = torch.autograd.grad(value, wrt, allow_unused=True)
    out = [torch.zeros_like(logp) if t is None else t for t in grads]
    return out[0], (out[1] if len(out) > 1 else None)


class _ChunkLossGrads:
    """The loss's gradient at each chunk's tokens: one eager call of the loss per chunk, or with
    ``graph`` (CUDA) the first chunk's call eager and the loss + its autograd captured once in a
    CUDA graph on the second, replayed for the rest. The loss reads the log-probs through
    `_Pass`'s persistent ``[T]`` buffers, so one capture serves every chunk, and a replay costs
    one launch instead of the loss's tens of small kernels and autograd's host work. A loss that
    cannot be captured (a host sync, say) falls back to eager calls, with a warning."""

    def __init__(
        self,
        loss: TokenLoss,
        logp: torch.Tensor,
        entropy: torch.Tensor | None,
        entropy_grad: bool,
        graph: bool,
    ) -> None:
        self.args = (loss, logp, entropy, entropy_grad)
        self.graph_wanted = graph and logp.is_cuda
        self.calls = 0
        self.graph: Any = None
        self.static: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.graph is None and self.graph_wanted and self.calls >= 1:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            g_logp, g_ent = self.static  # type: ignore[misc]
        else:
            g_logp, g_ent = _loss_grads(*self.args)
        self.calls += 1
        return g_logp[lo:hi], (None if g_ent is None else g_ent[lo:hi])

    def _capture(self) -> None:
        self.graph_wanted = False  # one attempt per call of head_loss
        main = torch.cuda.current_stream(self.args[1].device)
        stream = _side_stream(self.args[1].device, "capture")
        stream.wait_stream(main)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin()
                try:
                    static = _loss_grads(*self.args)
                finally:
                    graph.capture_end()
        except RuntimeError as err:
            logger.warning("head_loss: the loss cannot be captured in a CUDA graph (%s)", err)
            main.wait_stream(stream)
            return
        main.wait_stream(stream)
        self.graph, self.static = graph, static


class _Pass:
    """One call's constants and buffers: the token chunks, the outputs, the gradients."""

    def __init__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        group: Any,
        inv_temp: float,
        vocab_start: int,
        n_valid: int,
        chunk: int,
        with_entropy: bool,
        entropy_grad: bool,
        want_h: bool,
        want_w: bool,
        kernels: ModuleType | None,
        dweight_fp32: bool = False,
        overlap: Overlap = "none",
        graph_loss: bool = False,
    ) -> None:
        self.graph_loss = graph_loss
        self.targets, self.group, self.inv_temp = targets, group, inv_temp
        self.vocab_start, self.n_valid, self.kernels = vocab_start, n_valid, kernels
        self.with_entropy, self.entropy_grad = with_entropy, entropy_grad
        n_rows = hidden.shape[0]
        self.bounds = [(lo, min(lo + chunk, n_rows)) for lo in range(0, n_rows, chunk)]
        # the PyTorch path computes in fp32 (fp64 for fp64 inputs); the kernels' path keeps the
        # matmuls in the inputs' dtype
        dt = (
            hidden.dtype
            if kernels is not None
            else torch.promote_types(hidden.dtype, torch.float32)
        )
        self.stat_dtype = torch.promote_types(dt, torch.float32)
        self.hidden = hidden.to(dt)
        self.w_valid = weight[:n_valid].to(dt)
        dev = hidden.device
        self.logp = torch.zeros(n_rows, dtype=self.stat_dtype, device=dev)
        self.entropy = torch.zeros_like(self.logp) if with_entropy else None
        # a whole vocabulary on the kernels' path: one kernel writes logp / entropy / lse / E[z]
        self.finish = kernels is not None and group is None and self.stat_dtype == torch.float32
        self.grad_h: torch.Tensor | None = None
        self.grad_w: torch.Tensor | None = None
        self._acc_w: torch.Tensor | None = None
        if want_h:
            # every row is written once (by the matmul, in the inputs' dtype on the kernels'
            # path); a tensor-parallel sum over the shards is taken in fp32
            own_dtype = kernels is not None and group is None
            new = torch.empty if n_valid else torch.zeros
            self.grad_h = new(
                hidden.shape, dtype=hidden.dtype if own_dtype else self.stat_dtype, device=dev
            )
        if want_w:
            self.grad_w = torch.empty_like(weight)
            self.grad_w[n_valid:] = 0  # padding rows; the first chunk writes the others
            # the kernels' path sums straight into the gradient (weight's dtype), or with
            # ``dweight_fp32`` into an fp32 accumulator (one rounding at the end, twice the
            # weight's bytes more); the PyTorch path into an accumulator of the compute dtype
            # when that differs
            if kernels is not None and dweight_fp32 and weight.dtype != torch.float32:
                self._acc_w = torch.zeros(n_valid, weight.shape[1], dtype=torch.float32, device=dev)
            else:
                same = kernels is not None or weight.dtype == dt
                self._acc_w = self.grad_w[:n_valid] if same else torch.empty_like(self.w_valid)
                if n_rows == 0:
                    self._acc_w.zero_()
        # ``overlap`` (CUDA, both gradients): "dw" runs the weight-gradient addmm (memory-heavy:
        # it reads and writes the whole gradient) on a side stream beside the hidden-gradient
        # matmul; "pipeline" runs both gradient matmuls of chunk c on the side stream while the
        # main one makes chunk c + 1's logits, statistics and logits gradient, in a second buffer
        on_side = overlap != "none" and dev.type == "cuda" and want_h and want_w
        self.overlap = overlap if on_side and kernels is not None else "none"
        self.side = _side_stream(dev) if self.overlap != "none" else None
        self.buffers: list[torch.Tensor] = []  # the kernels' chunk logits, then their gradient
        self._free: list[Any] = [None, None]  # per buffer: the side stream's event, once read
        if kernels is not None and n_valid and n_rows:
            count = 2 if self.overlap == "pipeline" and len(self.bounds) > 1 else 1
            shape = (min(chunk, n_rows), n_valid)
            self.buffers = [torch.empty(shape, dtype=dt, device=dev) for _ in range(count)]

    # -- per chunk ---------------------------------------------------------------------------

    def logits(self, lo: int, hi: int, index: int) -> torch.Tensor:
        """``hidden[lo:hi] @ weight.T`` over the valid rows, unscaled: chunk ``index``'s kernels'
        buffer, or a fresh tensor on the PyTorch path."""
        h = self.hidden[lo:hi]
        if not self.buffers:
            return h @ self.w_valid.T
        slot = index % len(self.buffers)
        if self._free[slot] is not None:  # the side stream's matmuls of chunk index - 2
            torch.cuda.current_stream(h.device).wait_event(self._free[slot])
            self._free[slot] = None
        out = self.buffers[slot][: hi - lo]
        torch.mm(h, self.w_valid.T, out=out)
        return out

    def stats(
        self, logits: torch.Tensor, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Any]:
        """Writes the rows' log-probs (and entropy) and returns (lse, E[z] or None, combined over
        the group), the targets and the PyTorch path's ``exp(z - max)`` and scaled z, kept for
        the gradient."""
        t = self.targets[lo:hi]
        rows, dev, sd = hi - lo, self.logp.device, self.stat_dtype
        if self.finish and self.n_valid:
            ent = None if self.entropy is None else self.entropy[lo:hi]
            lse, mean_z = self.kernels.finished_stats(
                logits, t, self.n_valid, self.inv_temp, self.logp[lo:hi], ent
            )
            return lse, mean_z, t, None
        if self.n_valid == 0:  # this shard is all padding
            part = (
                torch.full((rows,), -math.inf, dtype=sd, device=dev),
                torch.zeros(rows, dtype=sd, device=dev),
                torch.zeros(rows, dtype=sd, device=dev) if self.with_entropy else None,
                torch.zeros(rows, dtype=sd, device=dev),
            )
            cache = None
        elif self.kernels is not None:
            part = self.kernels.local_stats(
                logits, t, self.vocab_start, self.n_valid, self.inv_temp, self.with_entropy
            )
            cache = None
        else:
            z = logits.mul_(self.inv_temp)
            m = z.amax(dim=1)
            e = (z - m[:, None]).exp_()
            local = t - self.vocab_start
            own = (local >= 0) & (local < self.n_valid)
            picked = z.gather(1, local.clamp(0, self.n_valid - 1)[:, None]).squeeze(1)
            part = (
                m,
                e.sum(dim=1),
                (e * z).sum(dim=1) if self.with_entropy else None,
                torch.where(own, picked, 0.0),
            )
            cache = (z, e, m)
        logp, lse, mean_z = _combine(*part, self.group)
        self.logp[lo:hi] = logp
        if self.entropy is not None:
            self.entropy[lo:hi] = lse - mean_z
        return lse, mean_z, t, cache

    def logits_grad(
        self,
        logits: torch.Tensor,
        t: torch.Tensor,
        lse: torch.Tensor,
        mean_z: torch.Tensor | None,
        g_logp: torch.Tensor,
        g_ent: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """``dL/dlogits`` of the chunk (unscaled logits), over the logits' storage."""
        if self.kernels is not None:
            g_ent32 = None if g_ent is None else g_ent.float()
            return self.kernels.logits_grad(
                logits,
                t,
                self.vocab_start,
                self.n_valid,
                self.inv_temp,
                lse,
                g_logp.float(),
                mean_z if g_ent is not None else None,
                g_ent32,
                out=logits,
            )
        z, e, m = cache
        p = e.mul_(torch.exp(m - lse)[:, None])  # exp(z - lse)
        if g_ent is not None:  # dH/dz_v = p_v (E[z] - z_v)
            d = z.neg_().add_(mean_z[:, None]).mul_(g_ent[:, None]).sub_(g_logp[:, None]).mul_(p)
        else:
            d = p.mul_(-g_logp[:, None])  # d logp / dz_v = onehot_v - p_v
        local = t - self.vocab_start
        own = (local >= 0) & (local < self.n_valid)
        d.scatter_add_(
            1, local.clamp(0, self.n_valid - 1)[:, None], torch.where(own, g_logp, 0.0)[:, None]
        )
        return d.mul_(self.inv_temp)

    def weight_grads(self, dz: torch.Tensor, lo: int, hi: int, index: int) -> None:
        """``dhidden[lo:hi] = dz @ W``, ``dweight += dz.T @ hidden[lo:hi]``: on the main stream,
        or (``overlap``) partly or wholly on the side stream; the stream that next writes
        ``dz``'s buffer waits for them."""
        if self.side is None:
            self._hidden_grad(dz, lo, hi)
            self._weight_grad(dz, lo, hi)
            return
        main = torch.cuda.current_stream(dz.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            if self.overlap == "pipeline":
                self._hidden_grad(dz, lo, hi)
            self._weight_grad(dz, lo, hi)
        if self.overlap == "dw":
            self._hidden_grad(dz, lo, hi)
            main.wait_stream(self.side)
            return
        done = torch.cuda.Event()
        done.record(self.side)
        self._free[index % len(self.buffers)] = done

    def _hidden_grad(self, dz: torch.Tensor, lo: int, hi: int) -> None:
        if self.grad_h is not None:
            out = self.grad_h[lo:hi]
            if out.dtype == dz.dtype:
                torch.mm(dz, self.w_valid, out=out)
            elif dz.is_cuda and _fp32_out_mm_works(dz.device.type):
                out.copy_(torch.mm(dz, self.w_valid, out_dtype=out.dtype))
            else:
                out.copy_(dz @ self.w_valid)

    def _weight_grad(self, dz: torch.Tensor, lo: int, hi: int) -> None:
        h = self.hidden[lo:hi]
        if self._acc_w is None:
            return
        if self._acc_w.dtype != dz.dtype:  # the fp32 accumulator (zeroed) of ``dweight_fp32``
            _accumulate_mm(self._acc_w, dz.T, h)
        elif lo == 0:
            torch.mm(dz.T, h, out=self._acc_w)
        else:
            self._acc_w.addmm_(dz.T, h)

    # -- the whole pass ----------------------------------------------------------------------

    def run(self, loss: TokenLoss) -> None:
        need_grads = self.grad_h is not None or self.grad_w is not None
        loss_grads = _ChunkLossGrads(
            loss, self.logp, self.entropy, self.entropy_grad, self.graph_loss
        )
        for index, (lo, hi) in enumerate(self.bounds):
            logits = self.logits(lo, hi, index) if self.n_valid else None
            lse, mean_z, t, cache = self.stats(logits, lo, hi)
            if not (need_grads and self.n_valid):  # forward only, or an all-padding shard
                continue
            g_logp, g_ent = loss_grads(lo, hi)
            dz = self.logits_grad(logits, t, lse, mean_z, g_logp, g_ent, cache)
            del logits, cache
            self.weight_grads(dz, lo, hi, index)
            del dz
        if self.side is not None:  # the last chunks' side-stream matmuls
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)

    def gradients(self) -> _Grads:
        grad_h = self.grad_h
        if grad_h is not None and self.group is not None:
            dist.all_reduce(grad_h, group=self.group)  # hidden is replicated: sum the shards
        grad_w = self.grad_w
        if grad_w is not None and self._acc_w is not None and self._acc_w.dtype != grad_w.dtype:
            grad_w[: self.n_valid] = self._acc_w
        return _Grads(grad_h, grad_w)


@functools.cache
def _side_stream(device: torch.device, role: str = "overlap") -> torch.cuda.Stream:
    """One side stream per device and role: the overlapped gradient matmuls, the capture of the
    loss's CUDA graph."""
    return torch.cuda.Stream(device=device)


def head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss: TokenLoss,
    *,
    tp_group: Any = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: int | None = None,
    kernel: Kernel = "auto",
    dweight_fp32: bool = False,
    overlap: Overlap = "none",
    graph_loss: bool = False,
) -> HeadLossOutput:
    """The loss of ``softmax(hidden @ weight.T / temperature)``'s per-token log-probs (and
    entropy) of ``targets``, with the gradients of ``hidden`` and ``weight`` made in the forward
    (see the module docstring). ``loss`` MUST be separable over tokens (`choose_head_path` says
    whether a configuration is); a loss that is not gets wrong gradients, not an error.

    Args:
        hidden: ``[T, H]`` final hidden states (after the last norm) in the head's dtype; the
            same on every rank of ``tp_group``.
        weight: ``[V_local, H]`` this rank's vocabulary shard of the LM head.
        targets: ``[T]`` global token ids in ``[0, vocab_size)``.
        loss: ``loss(logprobs [T], entropy [T] or None) -> (loss, metrics)``, called once per
            token chunk (for its gradient) and once on the complete detached log-probs (for the
            value and metrics): the backend's `unirl.core.backend.LossFn` with its microbatch.
        tp_group: the tensor-parallel group, or None when the vocabulary is whole.
        temperature: divides the logits for log-probs and entropy alike.
        vocab_size: the true vocabulary; weight rows at or beyond it (padding) are left out.
        with_entropy: hand the entropy to the loss (else None).
        entropy_grad: when False the entropy reaches the loss detached (reported only).
        chunk_size: token rows per chunk (default `default_token_chunk`).
        kernel: "auto" (Triton on CUDA tensors when importable, else PyTorch), "torch", "triton".
        dweight_fp32: on the kernels' path, sum the weight's gradient over the token chunks in
            fp32 (one rounding at the end) instead of in the weight's dtype (one per chunk), for
            twice the weight's bytes (benchmarks/fused_head.py --variants measures both).
        overlap: where the gradient matmuls run on CUDA (`Overlap`).
        graph_loss: on CUDA, capture the loss's per-chunk gradient call in a CUDA graph on the
            second chunk and replay it for the others (`_ChunkLossGrads`); the loss must then be
            capturable (no host syncs, the same work for every chunk), else eager calls.
    """
    inputs = prepare_hidden_inputs(
        "head_loss",
        hidden,
        weight,
        targets,
        tp_group=tp_group,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_size=vocab_size,
        kernel=kernel,
    )
    if overlap not in _OVERLAPS:
        raise LossInputError(f"head_loss: overlap={overlap!r}; valid: {', '.join(_OVERLAPS)}")
    hidden = inputs.hidden
    default_chunk = default_token_chunk(
        weight.shape[0], hidden.device, hidden.dtype, hidden.shape[0]
    )
    chunk = chunk_size if chunk_size is not None else default_chunk
    return _head_loss(
        hidden,
        weight,
        inputs.targets,
        loss,
        group=inputs.group,
        inv_temp=1.0 / temperature,
        vocab_start=inputs.vocab_start,
        n_valid=inputs.n_valid,
        chunk=chunk,
        with_entropy=with_entropy,
        entropy_grad=with_entropy and entropy_grad,
        kernels=inputs.kernels,
        dweight_fp32=dweight_fp32,
        overlap=overlap,
        graph_loss=graph_loss,
    )


def _head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    loss: TokenLoss,
    **options: Any,
) -> HeadLossOutput:
    """`head_loss` after its checks (``options``: `_Pass`'s; the tests call this with the
    kernels on the CPU, in Triton's interpreter)."""
    grad_on = torch.is_grad_enabled()
    state = _Pass(
        hidden.detach(),
        weight.detach(),
        targets,
        want_h=grad_on and hidden.requires_grad,
        want_w=grad_on and weight.requires_grad,
        **options,
    )
    with torch.no_grad():
        state.run(loss)
        grads = state.gradients()
    logp, entropy = state.logp, state.entropy
    value, metrics = loss(logp, entropy)
    if grads.hidden is not None or grads.weight is not None:
        value = value + _AttachGrads.apply(hidden, weight, grads)
    return HeadLossOutput(loss=value, metrics=metrics, logprobs=logp, entropy=entropy)
