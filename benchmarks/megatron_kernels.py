"""megatron-core's unfused packed RoPE, SwiGLU backward, torch RMSNorm and linear bias add against
unirl's fused kernels (`unirl.backends.megatron.kernels.gpu_fusions`), at the shapes of the 1.5B
throughput benchmark.

    PYTHONPATH=$PWD python benchmarks/megatron_kernels.py \\
        --out benchmarks/results/megatron_kernels/<date>_h200_<commit>.json

- **rope**: q ``[T, 12, 128]`` (contiguous, as megatron reshapes it) and k ``[T, 2, 128]`` (a
  strided view of the fused qkv projection, as megatron splits it), packed sequences of
  ``--min-len`` to ``--max-len`` tokens filling ``--tokens``; forward of q and k, and forward +
  backward. megatron's ``_apply_rotary_pos_emb_thd`` against `fused_rope.apply_rotary_pos_emb_thd`
  (its cos / sin tables built once per microbatch: timed apart as ``tables_ms``).
- **swiglu_back**: ``g [T, F]``, ``y [T, 2F]`` bf16 (F = 8,960): megatron's compiled
  ``swiglu_back`` against `fused_swiglu.swiglu_back`; megatron's compiled forward ``swiglu`` for
  scale (it moves 3/5 of the backward's bytes), and each one's effective bandwidth.
- **rmsnorm**: ``[T, 1, hidden]`` bf16 and Qwen3's per-head norm ``[T, heads, head_dim]``,
  forward + backward: ``torch.nn.RMSNorm`` against `fused_rmsnorm.TritonRMSNorm`, with the L2
  cache flushed before every call (a step's norm reads activations written long before; with
  them in L2 torch's two backward passes over ``x`` and ``dy`` look cheaper than they are).
- **qkv_bias**: the fused qkv projection ``[T, hidden] x [hidden, (heads + 2 kv) x head_dim]``
  with its bias: megatron's matmul + add against ``addmm`` (`linear_bias`), forward.

Each call is timed two ways: ``*_ms``, the median of ``--iters`` CUDA-event timings of isolated
calls after ``--warmup`` (small calls there include launch and autograd-engine latency), and
``*_kernel_ms``, the GPU kernel time per call from torch.profiler (what the call costs inside a
step, where the GPU is never idle; the L2 flush's own kernel left out). ``per_step_saving_ms`` multiplies each per-layer saving of
kernel time by ``--layers x --microbatches`` (28 x 9 on the benchmark: one forward and one
backward per layer and microbatch). CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.run_environment import run_environment


def cuda_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn: Callable[[], Any], iters: int, flush: torch.Tensor | None = None) -> float:
    """GPU kernel time per call (torch.profiler's CUDA self time, as megatron_throughput's
    ``--profile-dir`` sums it): what a call costs inside a step, where the GPU is never idle,
    without the launch and autograd-engine latency that an isolated small call waits on. With
    ``flush`` (a buffer larger than the L2 cache) the cache is overwritten before each call;
    the fill kernels are not counted."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if flush is not None:
                flush.fill_(1)
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages()
    total = sum(e.self_device_time_total for e in table if e.device_type.name == "CUDA")
    if flush is not None:  # the fill kernels: one per call, each over the whole buffer
        total -= sum(
            e.self_device_time_total
            for e in table
            if e.device_type.name == "CUDA" and "FillFunctor" in e.key
        )
    return total / 1e3 / iters


class OneRankGroup:
    """The context-parallel group megatron's RoPE asks for its size and rank (cp == 1)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def packed_bounds(tokens: int, min_len: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < tokens:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        bounds.append(min(tokens, bounds[-1] + n))
    return bounds


def bench_rope(args: argparse.Namespace, fused_rope: Any) -> dict[str, Any]:
    dev = torch.device("cuda")
    bounds = packed_bounds(args.tokens, args.min_len, args.max_len, args.seed)
    cu = torch.tensor(bounds, dtype=torch.int32)  # on the host, as unirl's packed params keep it
    dim, heads, groups = args.head_dim, args.heads, args.kv_heads
    # megatron's RotaryEmbedding table: [max_len, 1, 1, D], the two halves' angles alike
    inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=dev) / dim))
    angles = torch.outer(torch.arange(args.max_len, device=dev, dtype=torch.float32), inv)
    freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    per_group = heads // groups
    qkv = torch.randn(args.tokens, groups, (per_group + 2) * dim, device=dev, dtype=torch.bfloat16)
    group = OneRankGroup()
    megatron = fused_rope.ORIGINAL["_apply_rotary_pos_emb_thd"]

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        base = qkv.detach().requires_grad_()
        q = base[..., : per_group * dim].reshape(args.tokens, heads, dim)
        return q, base[..., per_group * dim : (per_group + 1) * dim]

    grads = [
        torch.randn(args.tokens, h, dim, device=dev, dtype=torch.bfloat16) for h in (heads, groups)
    ]

    def run(rope: Callable[..., torch.Tensor], backward: bool) -> Callable[[], None]:
        q, k = inputs()

        def step() -> None:
            outs = [rope(t, cu, freqs, cp_group=group) for t in (q, k)]
            if backward:
                torch.autograd.grad(outs, [q, k], grads, retain_graph=False)

        return step

    out: dict[str, Any] = {"sequences": len(bounds) - 1, "tokens": args.tokens}
    for name, rope in (("megatron", megatron), ("unirl", fused_rope.apply_rotary_pos_emb_thd)):
        # the q reshape (a copy megatron makes) is outside the timed region: both get it alike
        out[name] = {
            "forward_ms": cuda_ms(run(rope, False), args.warmup, args.iters),
            "forward_backward_ms": cuda_ms(run(rope, True), args.warmup, args.iters),
            "forward_kernel_ms": kernel_ms(run(rope, False), args.iters),
            "forward_backward_kernel_ms": kernel_ms(run(rope, True), args.iters),
        }
    rows = fused_rope.thd_freq_rows(bounds, cp_size=1, cp_rank=0, offsets=False)
    out["unirl"]["tables_ms"] = cuda_ms(
        lambda: fused_rope.rope_tables(freqs, rows, torch.bfloat16, 1.0), args.warmup, args.iters
    )
    # q and k read and written once each, forward and backward: the bandwidth floor's bytes
    out["bytes_forward"] = 2 * 2 * args.tokens * (heads + groups) * dim
    q, k = inputs()
    want = [megatron(t, cu, freqs, cp_group=group) for t in (q, k)]
    got = [fused_rope.apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=group) for t in (q, k)]
    out["identical_forward"] = all(torch.equal(a, b) for a, b in zip(want, got))
    return out


def bench_swiglu(args: argparse.Namespace, fused_swiglu: Any) -> dict[str, Any]:
    from megatron.core.fusions import fused_bias_swiglu

    dev = torch.device("cuda")
    t, f = args.tokens, args.ffn
    y = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16)
    g = torch.randn(t, f, device=dev, dtype=torch.bfloat16)
    megatron_back = fused_swiglu.ORIGINAL["swiglu_back"]
    out: dict[str, Any] = {}
    for name, fn, moved in (
        ("megatron_forward", lambda: fused_bias_swiglu.swiglu(y), 3 * t * f * 2),
        ("megatron_backward", lambda: megatron_back(g, y), 5 * t * f * 2),
        ("unirl_backward", lambda: fused_swiglu.swiglu_back(g, y), 5 * t * f * 2),
    ):
        ms = cuda_ms(fn, args.warmup, args.iters)
        kernel = kernel_ms(fn, args.iters)
        out[name] = {
            "ms": ms,
            "kernel_ms": kernel,
            "bytes": moved,
            "tb_per_s": moved / kernel / 1e9,
        }
    want, got = megatron_back(g, y).float(), fused_swiglu.swiglu_back(g, y).float()
    out["max_abs_diff_vs_megatron"] = (want - got).abs().max().item()
    return out


def l2_flush_buffer() -> torch.Tensor:
    """Bytes enough to evict the whole L2 cache (four times its size)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return torch.empty(4 * max(props.L2_cache_size, 1 << 20), dtype=torch.uint8, device="cuda")


def bench_rmsnorm(args: argparse.Namespace, fused_rmsnorm: Any) -> dict[str, Any]:
    dev, t, dtype = torch.device("cuda"), args.tokens, torch.bfloat16
    flush = l2_flush_buffer()
    out: dict[str, Any] = {}
    for label, shape in (
        ("hidden", (t, 1, args.hidden)),
        ("qk_head", (t, args.heads, args.head_dim)),
    ):
        width = shape[-1]
        x = torch.randn(*shape, device=dev, dtype=dtype)
        dy = torch.randn(*shape, device=dev, dtype=dtype)
        rows: dict[str, Any] = {}
        results = []
        for name, cls in (("torch", torch.nn.RMSNorm), ("unirl", fused_rmsnorm.TritonRMSNorm)):
            norm = cls(width, eps=1e-6, device=dev, dtype=dtype)

            def step(
                norm: torch.nn.Module = norm, x: torch.Tensor = x, dy: torch.Tensor = dy
            ) -> tuple[torch.Tensor, ...]:
                xx = x.detach().requires_grad_()
                y = norm(xx)
                return (y, *torch.autograd.grad(y, (xx, norm.weight), dy))

            rows[name] = {
                "forward_kernel_ms": kernel_ms(lambda norm=norm, x=x: norm(x), args.iters, flush),
                "forward_backward_kernel_ms": kernel_ms(step, args.iters, flush),
                "forward_backward_ms": cuda_ms(step, args.warmup, args.iters),
            }
            results.append(step())
        rows["max_abs_diff_vs_torch"] = {
            k: (a.float() - b.float()).abs().max().item()
            for k, a, b in zip(("output", "dx", "dweight"), *results)
        }
        out[label] = {"shape": list(shape), **rows}
    return out


def bench_qkv_bias(args: argparse.Namespace) -> dict[str, Any]:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    width = (args.heads + 2 * args.kv_heads) * args.head_dim
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
    w = torch.randn(width, args.hidden, device=dev, dtype=dtype) * args.hidden**-0.5
    b = torch.randn(width, device=dev, dtype=dtype)
    exact = x.double() @ w.double().T + b.double()
    out: dict[str, Any] = {"shape": [args.tokens, args.hidden, width]}
    for name, fn in (
        ("megatron_matmul_add", lambda: torch.matmul(x, w.t()) + b),
        ("matmul_alone", lambda: torch.matmul(x, w.t())),
        ("unirl_addmm", lambda: torch.addmm(b, x, w.t())),
    ):
        out[name] = {
            "ms": cuda_ms(fn, args.warmup, args.iters),
            "kernel_ms": kernel_ms(fn, args.iters),
        }
        if name != "matmul_alone":
            out[name]["max_abs_err_vs_float64"] = (fn().double() - exact).abs().max().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--microbatches", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("megatron_kernels.py times CUDA kernels: run it on a GPU")

    from unirl.backends.megatron.kernels import fused_rmsnorm, fused_rope, fused_swiglu, gpu_fusions

    shape = gpu_fusions.ProbeShape(
        args.head_dim, (args.kv_heads, args.heads), norm_widths=(args.head_dim, args.hidden)
    )
    if not gpu_fusions.install(shape):
        raise SystemExit(f"unirl's megatron fusions are {gpu_fusions.status()}")
    rope = bench_rope(args, fused_rope)
    swiglu = bench_swiglu(args, fused_swiglu)
    rmsnorm = bench_rmsnorm(args, fused_rmsnorm)
    qkv_bias = bench_qkv_bias(args)
    calls = args.layers * args.microbatches
    # from kernel time: inside the step the GPU is busy, so launch latency hides
    rope_kernel = "forward_backward_kernel_ms"
    saving = {
        "rope_ms": calls * (rope["megatron"][rope_kernel] - rope["unirl"][rope_kernel])
        - args.microbatches * rope["unirl"]["tables_ms"],
        "swiglu_back_ms": calls
        * (swiglu["megatron_backward"]["kernel_ms"] - swiglu["unirl_backward"]["kernel_ms"]),
        # two norms per layer (input and pre-MLP) and microbatch, plus the final norm
        "rmsnorm_ms": (2 * calls + args.microbatches)
        * (
            rmsnorm["hidden"]["torch"]["forward_backward_kernel_ms"]
            - rmsnorm["hidden"]["unirl"]["forward_backward_kernel_ms"]
        ),
        "qkv_bias_ms": calls
        * (qkv_bias["megatron_matmul_add"]["kernel_ms"] - qkv_bias["unirl_addmm"]["kernel_ms"]),
    }
    report = {
        "environment": run_environment(("megatron-core", "triton")),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rope": rope,
        "swiglu": swiglu,
        "rmsnorm": rmsnorm,
        "qkv_bias": qkv_bias,
        "per_step_saving_ms": saving,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
