"""Running a packed microbatch through a Hugging Face model (on every HF engine: DeepSpeed, FSDP2):
one ``[1, T]`` stream, attention kept inside each sequence by a registered *varlen* attention
function.

A `TrainMicrobatch` arrives packed: tokens flat, ``cu_seqlens`` marking sequence bounds,
``position_ids`` restarting at each sequence. The model runs on exactly that stream (no padding,
so the logits ``[T, V]`` are already in the order of ``mb.targets``: no gather, no copy) and every
attention layer attends within its own sequence only:

- CUDA, bf16/fp16: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over ``cu_seqlens``,
  causal = ``window_size=(-1, 0)``);
- otherwise (the CPU, fp32): the sequences, longest first, form buckets of similar length; each
  bucket is one right-padded ``[rows, H, longest, D]`` causal SDPA call (`bucket_plan`). Only
  attention sees the padding: every other layer runs on the packed ``T`` tokens.

Why this layout. Forward + backward (log-probs from the logits included) of 8 sequences through a
4-layer llama, in tokens/s and peak memory (CPU: process RSS; GPU: extra allocated memory):

- CPU, hidden 64, 1 thread, lengths 7..512 (T = 1730, L_max = 512):
  block-diagonal mask 0.94-0.97k tok/s, 577 MiB; right-padded 1.06-1.09k tok/s, 633 MiB;
  varlen (this file) 2.8-3.6k tok/s, 520 MiB.
- CPU, same model, lengths 180..220 (T = 1600): mask 0.83-0.95k tok/s, 545 MiB; padded
  4.3-7.0k tok/s, 510 MiB; varlen 3.6-7.2k tok/s, 500 MiB (a shared 2-core machine: runs vary
  up to 2x).
- H200, bf16, hidden 1024, lengths 70..4096 (T = 16276): mask 192k tok/s, 5.4 GiB; padded
  354k tok/s, 5.7 GiB; varlen 573k tok/s, 3.0 GiB.
- H200, same model, lengths 1800..2200 (T = 16000): mask 219k tok/s, 5.2 GiB; padded 596k tok/s,
  3.0 GiB; varlen 600k tok/s, 2.9 GiB.

A block-diagonal mask costs ``T^2`` attention work and a ``T^2`` mask and rules out the flash
kernel; right padding (``[S, L_max]``, causal SDPA, then gathering the ``[T]`` valid positions)
computes every layer on ``S * L_max - T`` pad tokens, which dominates when lengths vary, as RL
responses do. Varlen attention does neither; it was fastest or tied in every case. HF's own
packed-sequence support (detecting restarts in ``position_ids``) builds the same ``T^2`` mask
for SDPA, so it is not used.

Attention on the CPU: per bucket, not per sequence. The first CPU path called SDPA once per
sequence (``q[:, :, a:b]`` slices): on RL's many short sequences the calls, and the backward of
each slice (a zero tensor the size of the whole stream, per sequence and layer), cost more than
the attention. In-process A/B, forward + backward of the tiny example's model (hidden 128, 2
layers, 1 thread, a 2-core machine shared with other jobs, medians of 5-9 interleaved rounds):

- 4 microbatches of 32 sequences of 5-13 tokens: per-sequence 0.063 s, one block-diagonal masked
  call per microbatch 0.051 s, one right-padded call (one bucket) 0.044 s;
- 1 microbatch of 128 such sequences: per-sequence 0.109 s, masked 0.094 s, padded 0.044 s;
- 2 microbatches of 8 / 32 sequences of 20..300 tokens: per-sequence 0.11 / 0.78 s, masked
  0.21 / 4.05 s, one padded call 0.14 / 0.66 s; buckets (``BUCKET_SPLIT``) 0.27-0.31 / 0.82-0.87
  against per-sequence 0.40 / 0.98 in a second, busier round.

- the training phase (``RLStep.run``) of ``benchmarks/cpu_vs_trl.py``'s long workload, 128
  responses of 1-256 tokens (mean 66-71) in one microbatch, two interleaved rounds:
  ``BUCKET_SPLIT`` 1024: 1.05 s, 4096: 1.11 / 0.95 s, 8192: 1.05 s, 16384: 1.63 s, one padded
  call 2.0 s, per-sequence calls on ``split`` views 1.68 / 1.07 s.

So one padded call wins on short sequences and loses to per-sequence calls when lengths spread
(padding to the longest is wasted attention work); buckets give the first when lengths are close
and approach the second when they are not. A masked call loses everywhere (``T^2`` work).

Limits: the attention function refuses (rather than silently ignores) a sliding window shorter
than a sequence, logit soft-capping and attention sinks; models that need them need another
layout.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from unirl.backends.cudnn_attention import cudnn_packed, use_cudnn
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.errors import ConfigError

ATTN_NAME = "unirl_packed_varlen"
_REGISTERED: set[str] = set()  # attention functions registered with transformers


@functools.cache
def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return varlen_attn


def _repeat_kv(x: torch.Tensor, n_rep: int, head_dim: int) -> torch.Tensor:
    """Grouped-query attention: repeat each key/value head for its ``n_rep`` query heads."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=head_dim)


def _check_supported(module: Any, kwargs: dict[str, Any], max_len: int) -> None:
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None and max_len > window:
        raise ConfigError(
            f"model attention layer {type(module).__name__} uses a sliding window of {window} "
            f"tokens and a sequence here has {max_len}; the packed varlen attention of "
            "the Hugging Face backends (deepspeed, fsdp2) does not implement sliding windows. Keep "
            "sequences within the window (model.max_seq_len), turn the window off in the model "
            "config, or use backend: megatron"
        )
    for key in ("softcap", "s_aux"):
        if kwargs.get(key) is not None:
            raise ConfigError(
                f"model attention layer {type(module).__name__} passes {key}= (logit soft-capping "
                "or attention sinks); the packed varlen attention of the Hugging Face backends "
                "does not implement it; use a model without it"
            )


def packed_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: ``query [1, H, T, D]``, ``key/value [1, H_kv, T, D]``
    -> ``[1, T, H, D]``, causal within each sequence of ``cu_seq_lens_q``."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise RuntimeError(
            f"attention {ATTN_NAME!r} needs cu_seq_lens_q: call the model through "
            "unirl.backends.hf.packed.forward_packed"
        )
    max_len = int(kwargs["max_length_q"])
    _check_supported(module, kwargs, max_len)
    if dropout and module.training:
        raise ConfigError(
            f"model attention dropout={dropout} is not supported by the packed attention; set "
            "attention_dropout: 0 in the model config (RL training runs without dropout)"
        )
    varlen = _varlen_attn()
    if varlen is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        n_rep = query.shape[1] // key.shape[1]
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        if use_cudnn(q, max_len):  # long sequences: cuDNN's kernel (unirl.backends.cudnn_attention)
            scale = scaling if scaling is not None else q.shape[-1] ** -0.5
            bounds = [0, max_len] if max_len == q.shape[0] else cu.tolist()

            def flash_one(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
                n = qs.shape[0]
                c = torch.tensor([0, n], dtype=torch.int32, device=qs.device)
                ks, vs = _repeat_kv(ks, n_rep, 1), _repeat_kv(vs, n_rep, 1)
                return varlen(qs, ks, vs, c, c, n, n, scale=scale, window_size=(-1, 0))

            return cudnn_packed(q, k, v, bounds, scale, flash_one)[None], None
        k, v = _repeat_kv(k, n_rep, 1), _repeat_kv(v, n_rep, 1)
        out = varlen(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0))
        return out[None], None
    return _bucketed_sdpa(query, key, value, cu, scaling), None


@attrs.frozen
class _Bucket:
    """Sequences of similar length run as one right-padded ``[n, H, length, D]`` SDPA call."""

    rows: int  # sequences in the bucket
    length: int  # its longest sequence; the others are padded to it
    gather: torch.Tensor  # [rows * length] token index of each padded slot (pads read token 0)


@attrs.frozen
class _BucketPlan:
    buckets: tuple[_Bucket, ...]
    # [T]: where token t's output sits in the buckets' padded outputs, concatenated
    scatter: torch.Tensor


# Start a new bucket when padding the next (shorter) sequence to the bucket's longest would cost
# more attention work (length^2) than a 64-token sequence's: about what one more SDPA call costs
# on the CPU (its launch, the view and the autograd nodes), see the module docstring.
BUCKET_SPLIT = 64 * 64

_plan_cache: tuple[torch.Tensor, _BucketPlan] | None = None


def bucket_plan(cu_seqlens: torch.Tensor) -> _BucketPlan:
    """Group the sequences of ``cu_seqlens`` into buckets of similar length (longest first).

    A pad slot gathers token 0; it is a key only for the pad queries after it in its row (right
    padding + causal mask), and those queries' outputs are dropped, so every real query sees its
    own sequence only and no gradient reaches the pad slots."""
    device = cu_seqlens.device  # the plan lives where attention runs: no copy per layer
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = cu_seqlens[:-1].tolist()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if not groups or lengths[groups[-1][0]] ** 2 - lengths[i] ** 2 > BUCKET_SPLIT:
            groups.append([])
        groups[-1].append(i)
    buckets, token_ids, slots = [], [], []
    offset = 0
    for members in groups:
        longest = lengths[members[0]]
        step = torch.arange(longest)
        first = torch.tensor([starts[i] for i in members])[:, None]
        real = step[None, :] < torch.tensor([lengths[i] for i in members])[:, None]
        index = torch.where(real, first + step, 0).flatten()
        buckets.append(_Bucket(rows=len(members), length=longest, gather=index.to(device)))
        real = real.flatten()
        token_ids.append(index[real])
        slots.append(torch.arange(offset, offset + index.numel())[real])
        offset += index.numel()
    scatter = torch.empty(int(cu_seqlens[-1]), dtype=torch.long)
    scatter[torch.cat(token_ids)] = torch.cat(slots)
    return _BucketPlan(buckets=tuple(buckets), scatter=scatter.to(device))


def _cached_bucket_plan(cu_seqlens: torch.Tensor) -> _BucketPlan:
    """Every layer of one forward (and its recomputation under activation checkpointing) gets
    the same ``cu`` tensor: plan once per microbatch. The cache holds ``cu`` itself, so the
    identity test cannot match a new tensor at a reused address."""
    global _plan_cache
    if _plan_cache is None or _plan_cache[0] is not cu_seqlens:
        _plan_cache = (cu_seqlens, bucket_plan(cu_seqlens))
    return _plan_cache[1]


def _bucketed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """Causal SDPA within each sequence, one call per bucket of similar-length sequences:
    ``[1, H, T, D]`` in, ``[1, T, H, D]`` out."""
    plan = _cached_bucket_plan(cu_seqlens)
    gqa = query.shape[1] != key.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    outs = []
    for b in plan.buckets:

        def padded(x: torch.Tensor, b: _Bucket = b) -> torch.Tensor:
            return x.index_select(0, b.gather).view(b.rows, b.length, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), is_causal=True, scale=scaling, enable_gqa=gqa
        )  # [rows, H, length, D]
        outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat.index_select(0, plan.scatter)[None]


def register_attention(model: Any, name: str, function: Any, *, needed_for: str) -> None:
    """Register ``function`` with transformers under ``name`` (once) and switch `model` to it."""
    from transformers import AttentionInterface

    if name not in _REGISTERED:
        AttentionInterface.register(name, function)
        _REGISTERED.add(name)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ConfigError(
            f"model {type(model).__name__} cannot switch its attention implementation (it does "
            f"not use transformers' AttentionInterface); {needed_for} needs that"
        )


def use_packed_attention(model: Any) -> None:
    """Switch `model` to the packed varlen attention."""
    register_attention(model, ATTN_NAME, packed_attention, needed_for="running packed sequences")


def forward_packed(module: Any, mb: TrainMicrobatch, device: torch.device) -> torch.Tensor:
    """Logits ``[T, V]`` of the packed microbatch (row ``t`` predicts ``mb.targets[t]``).

    `module` is the engine (DeepSpeed's) or the HF model, switched by `use_packed_attention`. An empty
    microbatch (``T = 0``) runs one pad token and returns its logits ``[1, V]``: under ZeRO every
    rank must run the same forward/backward collectives, also a rank with no tokens.
    """
    if mb.num_tokens == 0:
        tokens = torch.zeros(1, dtype=torch.long, device=device)
        positions = torch.zeros(1, dtype=torch.long, device=device)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
        max_len = 1
    else:
        tokens = mb.tokens.to(device, torch.long)
        positions = mb.position_ids.to(device, torch.long)
        cu = mb.cu_seqlens.to(device, torch.int32)
        max_len = max(mb.sequence_lengths)
    out = module(
        input_ids=tokens[None],
        position_ids=positions[None],
        use_cache=False,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=max_len,
        max_length_k=max_len,
    )
    return out.logits[0]
