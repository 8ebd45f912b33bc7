"""Time and peak memory of per-token log-probs from logits on one CUDA GPU.

Compares `unirl.core.maths.logprobs.logprobs_from_logits` (Triton kernels; and its chunked PyTorch
path) with the naive ``log_softmax(logits.float()).gather(...)`` and ``torch.compile`` of that
naive form, forward-only (under ``no_grad``, as for old/reference log-probs) and forward+backward
(as in training), at several sizes. Times are CUDA-event medians after warm-up; memory is
``max_memory_allocated`` during one call minus what was allocated before it (for
forward+backward this includes the gradient left in ``logits.grad``).

    PYTHONPATH=$PWD python benchmarks/logprobs.py --out benchmarks/results/logprobs/<date>_h200_<commit>.json

``--sweep`` also times the two Triton kernels alone over block sizes and warp counts at the
first size, which is how `fwd_config` and `bwd_config` in `unirl.core.maths.kernels.logprobs_triton` were chosen.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from unirl.core.maths.logprobs import logprobs_from_logits

GIB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SIZES = ["16384x151936:bf16", "4096x151936:bf16", "16384x32000:bf16", "8192x151936:fp32"]
METHODS = ("naive", "compile", "unirl", "unirl_entropy", "unirl_torch")


def naive(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def make_fn(method: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if method == "naive":
        return naive
    if method == "compile":
        torch._dynamo.reset()  # a fresh compile per size, never the recompile limit
        return torch.compile(naive, dynamic=False)
    if method == "unirl":
        return lambda x, t: logprobs_from_logits(x, t)
    if method == "unirl_torch":
        return lambda x, t: logprobs_from_logits(x, t, kernel="torch")
    if method == "unirl_entropy":

        def with_entropy(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            logp, entropy = logprobs_from_logits(x, t, with_entropy=True)
            return logp + 0.01 * entropy  # an entropy bonus: both gradients are computed

        return with_entropy
    raise ValueError(f"unknown method {method!r}; valid: {METHODS}")


def cuda_time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def peak_extra_gib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / GIB


def bench_size(spec: str, methods: list[str], warmup: int, reps: int) -> list[dict]:
    shape, dtype_name = spec.split(":")
    n_tokens, vocab = (int(v) for v in shape.split("x"))
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n_tokens, vocab, device="cuda", generator=gen) * 2).to(dtype)
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda", generator=gen)
    x = logits.detach().requires_grad_(True)
    logits_bytes = logits.numel() * logits.element_size()
    reference = naive(logits, targets)
    rows = []
    for method in methods:
        fn = make_fn(method)

        def fwd(fn=fn) -> None:
            with torch.no_grad():
                fn(x, targets)

        def fwd_bwd(fn=fn) -> None:
            x.grad = None
            fn(x, targets).sum().backward()

        with torch.no_grad():  # the entropy method returns logp + 0.01 H: no like-for-like
            max_diff = (
                None
                if method == "unirl_entropy"
                else ((fn(x, targets) - reference).abs().max().item())
            )
        row = {
            "size": spec,
            "tokens": n_tokens,
            "vocab": vocab,
            "dtype": dtype_name,
            "logits_gib": logits_bytes / GIB,
            "method": method,
            "max_abs_diff_vs_naive": max_diff,
        }
        for mode, call in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
            ms = cuda_time_ms(call, warmup, reps)
            x.grad = None
            mem = peak_extra_gib(call)
            x.grad = None
            # fewest bytes: read the logits once (fwd); read them and write the gradient (bwd)
            moved = logits_bytes * (1 if mode == "fwd" else 3)
            row[f"{mode}_ms"] = ms
            row[f"{mode}_extra_gib"] = mem
            row[f"{mode}_extra_x_logits"] = mem * GIB / logits_bytes
            row[f"{mode}_gb_per_s"] = moved / ms / 1e6
        rows.append(row)
        print(
            f"{spec:>20} {method:>14}  fwd {row['fwd_ms']:8.2f} ms {row['fwd_extra_gib']:6.2f} GiB"
            f"  fwd+bwd {row['fwd_bwd_ms']:8.2f} ms {row['fwd_bwd_extra_gib']:6.2f} GiB"
            f" ({row['fwd_bwd_extra_x_logits']:.2f}x)  max|diff| {max_diff}",
            flush=True,
        )
    return rows


def sweep(spec: str, warmup: int, reps: int) -> list[dict]:
    """Both kernels alone over (BLOCK_V, num_warps): which launch shape reads fastest."""
    from unirl.core.maths.kernels import logprobs_triton as k

    shape, dtype_name = spec.split(":")
    n_tokens, vocab = (int(v) for v in shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(n_tokens, vocab, device="cuda", generator=gen) * 2).to(DTYPES[dtype_name])
    targets = torch.randint(0, vocab, (n_tokens,), device="cuda", generator=gen)
    stats = k.local_stats(logits, targets, 0, vocab, 1.0, True)
    lse = stats[0] + torch.log(stats[1])
    mean_z = stats[2] / stats[1]
    g = torch.ones(n_tokens, device="cuda")
    logits_bytes = logits.numel() * logits.element_size()
    out = []
    for cfg in [
        (1024, 4),
        (2048, 2),
        (2048, 4),
        (2048, 8),
        (4096, 8),
        (4096, 16),
        (8192, 8),
        (8192, 16),
        (16384, 16),
    ]:
        row = {"size": spec, "block_v": cfg[0], "num_warps": cfg[1]}
        for name, call, moved in (
            ("stats", lambda c=cfg: k.local_stats(logits, targets, 0, vocab, 1.0, False, c), 1),
            ("stats_entropy", lambda c=cfg: k.local_stats(logits, targets, 0, vocab, 1.0, True, c), 1),
            ("grad", lambda c=cfg: k.logits_grad(logits, targets, 0, vocab, 1.0, lse, g, None, None, c), 2),
            ("grad_entropy", lambda c=cfg: k.logits_grad(logits, targets, 0, vocab, 1.0, lse, g, mean_z, g, c), 2),
        ):  # fmt: skip
            try:
                ms = cuda_time_ms(call, warmup, reps)
            except Exception as err:  # a launch shape the compiler refuses: record and go on
                row[f"{name}_error"] = repr(err)[:200]
                continue
            row[f"{name}_ms"] = ms
            row[f"{name}_gb_per_s"] = moved * logits_bytes / ms / 1e6
        out.append(row)
        print(
            f"sweep {spec} BLOCK_V={cfg[0]:>5} warps={cfg[1]:>2}  "
            + "  ".join(
                f"{n} {row.get(n + '_ms', float('nan')):.3f}"
                for n in ("stats", "stats_entropy", "grad", "grad_entropy")
            ),
            flush=True,
        )
    return out


def environment() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(),
        "gpu_memory_gib": torch.cuda.get_device_properties(0).total_memory / GIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, help="TOKENSxVOCAB:DTYPE")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--sweep", action="store_true", help="also sweep the kernels' launch shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/logprobs.py needs a CUDA GPU")

    result = {"environment": environment(), "results": [], "sweep": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        result["sweep"] = sweep(args.sizes[0], args.warmup, args.reps)
        out.write_text(json.dumps(result, indent=1))
    for spec in args.sizes:
        result["results"] += bench_size(spec, args.methods, args.warmup, args.reps)
        torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=1))  # keep what is done if a later size fails

    print(
        f"\n{'size':>20} {'method':>14} {'fwd ms':>8} {'fwd GiB':>8} {'f+b ms':>8} {'f+b GiB':>8}"
    )
    for r in result["results"]:
        print(
            f"{r['size']:>20} {r['method']:>14} {r['fwd_ms']:8.2f} {r['fwd_extra_gib']:8.2f}"
            f" {r['fwd_bwd_ms']:8.2f} {r['fwd_bwd_extra_gib']:8.2f}"
        )
    print(json.dumps(result["environment"]))


if __name__ == "__main__":
    main()
