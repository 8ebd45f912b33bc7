"""Time and peak extra memory of the LM head + per-token log-probs, forward + backward.

Methods, each from the final hidden states ``[T, H]`` and the head's weight ``[V, H]`` to the
gradients of both under random per-token upstream gradients:

- ``matmul_kernel``: ``logits = hidden @ weight.T`` (cuBLAS) + `logprobs_from_logits` (today's
  Triton kernels), issue #19's (a);
- ``matmul_naive``: the same matmul + ``log_softmax(logits.float()).gather`` (the naive form);
- ``fused``: `logprobs_from_hidden` (vocabulary chunks, no ``[T, V]`` logits), issue #19's (b);
- ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss`` (mean cross-entropy: no
  per-token upstream gradient, no entropy, no temperature), issue #19's (c); recorded as skipped
  when liger-kernel is not importable;
- with ``--entropy``: ``matmul_kernel_entropy`` and ``fused_entropy``, log-probs and entropy with
  both gradients (an entropy bonus).

Times are medians over ``--iters`` timed iterations after ``--warmup``: CUDA events on a GPU;
on the CPU ``perf_counter`` with the methods interleaved round by round (an in-process A/B that
a busy machine slows alike). Memory (CUDA only) is ``max_memory_allocated`` during one
iteration minus what was allocated before it (the inputs); it includes the gradients of the
hidden states and the weight, which every method makes. ``logits_gib`` is the ``[T, V]`` logits
in the compute dtype, for scale; ``beyond_grads_gib`` is the peak minus the two gradients
(``grads_gib``), what a method holds besides them. ``forward_only`` times ``matmul_kernel`` and ``fused`` under
``no_grad`` (the old-policy and reference passes).

    PYTHONPATH=$PWD python benchmarks/fused_head.py --device cuda \\
        --out benchmarks/results/fused_head_h200.json
    PYTHONPATH=$PWD python benchmarks/fused_head.py --device cpu --dtype fp32 \\
        --tokens 384,4096 --hidden 128,512 --vocab 16,32000 --methods matmul_kernel,fused \\
        --out /tmp/fused_head_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.run_environment import run_environment
from unirl.core.maths.logprobs import logprobs_from_logits
from unirl.core.maths.logprobs_hidden import logprobs_from_hidden

logger = logging.getLogger("fused_head")

GIB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("matmul_kernel", "matmul_naive", "fused", "liger")
ENTROPY_METHODS = ("matmul_kernel_entropy", "fused_entropy")
FORWARD_ONLY_METHODS = ("matmul_kernel", "fused")

# One iteration: (hidden, weight, targets, w_logp, w_ent) -> the scalar whose backward is timed.
Step = Callable[..., torch.Tensor]


def _liger_loss() -> Any:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()


def make_step(method: str, temperature: float) -> Step:
    if method in ("matmul_kernel", "matmul_kernel_entropy"):
        entropy = method.endswith("entropy")

        def matmul_kernel(h, w, t, w_logp, w_ent):
            logits = h @ w.T
            if entropy:
                logp, ent = logprobs_from_logits(
                    logits, t, temperature=temperature, with_entropy=True
                )
                return (w_logp * logp).sum() + (w_ent * ent).sum()
            return (w_logp * logprobs_from_logits(logits, t, temperature=temperature)).sum()

        return matmul_kernel
    if method == "matmul_naive":

        def matmul_naive(h, w, t, w_logp, w_ent):
            logp_all = torch.log_softmax((h @ w.T).float() / temperature, dim=-1)
            return (w_logp * logp_all.gather(1, t[:, None]).squeeze(1)).sum()

        return matmul_naive
    if method in ("fused", "fused_entropy"):
        entropy = method.endswith("entropy")

        def fused(h, w, t, w_logp, w_ent):
            if entropy:
                logp, ent = logprobs_from_hidden(
                    h, w, t, temperature=temperature, with_entropy=True
                )
                return (w_logp * logp).sum() + (w_ent * ent).sum()
            return (w_logp * logprobs_from_hidden(h, w, t, temperature=temperature)).sum()

        return fused
    if method == "liger":
        loss = _liger_loss()
        return lambda h, w, t, w_logp, w_ent: loss(w, h, t)
    raise ValueError(f"unknown method {method!r}; valid: {METHODS + ENTROPY_METHODS}")


def make_inputs(
    tokens: int, hidden: int, vocab: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, device=device).to(dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g, device=device) * hidden**-0.5).to(dtype)
    w.requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    w_logp = torch.randn(tokens, generator=g, device=device) / tokens
    w_ent = torch.randn(tokens, generator=g, device=device) / tokens
    return h, w, t, w_logp, w_ent


def one_iteration(step: Step, inputs: tuple[torch.Tensor, ...]) -> None:
    h, w = inputs[0], inputs[1]
    h.grad = None
    w.grad = None
    step(*inputs).backward()


def forward_only(step: Step) -> Step:
    """The same method under no_grad: old-policy and reference log-probs."""

    def run(*inputs: torch.Tensor) -> None:
        with torch.no_grad():
            step(*inputs)

    return run


def one_forward(step: Step, inputs: tuple[torch.Tensor, ...]) -> None:
    step(*inputs)


def cuda_measure(
    step: Step, inputs: tuple, warmup: int, iters: int, run: Callable = one_iteration
) -> dict[str, Any]:
    for _ in range(warmup):
        run(step, inputs)
    inputs[0].grad = inputs[1].grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(step, inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(step, inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {
        "ms_median": round(statistics.median(times), 3),
        "ms_min": round(min(times), 3),
        "peak_extra_gib": round(peak / GIB, 3),
    }


def cpu_measure(
    steps: dict[str, Step], inputs: tuple, warmup: int, iters: int, run: Callable = one_iteration
) -> dict:
    """Interleaved rounds: every method once per round, so load changes hit all alike."""
    times: dict[str, list[float]] = {m: [] for m in steps}
    for r in range(warmup + iters):
        for method, step in steps.items():
            t0 = time.perf_counter()
            run(step, inputs)
            if r >= warmup:
                times[method].append((time.perf_counter() - t0) * 1e3)
    return {
        m: {"ms_median": round(statistics.median(v), 3), "ms_min": round(min(v), 3)}
        for m, v in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--tokens", default="16384,65536")
    parser.add_argument("--hidden", default="1536,3584")
    parser.add_argument("--vocab", default="151936")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--entropy", action="store_true", help="also " + ", ".join(ENTROPY_METHODS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    methods = [m for m in args.methods.split(",") if m]
    if args.entropy:
        methods += list(ENTROPY_METHODS)
    skipped = {}
    if "liger" in methods and importlib.util.find_spec("liger_kernel") is None:
        skipped["liger"] = "liger-kernel is not installed (pip install liger-kernel)"
    elif "liger" in methods and args.device != "cuda":
        skipped["liger"] = "liger-kernel runs on CUDA only"
    if "liger" in skipped:
        methods.remove("liger")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    results = []
    for tokens, hidden, vocab in itertools.product(
        ints(args.tokens), ints(args.hidden), ints(args.vocab)
    ):
        row: dict[str, Any] = {
            "tokens": tokens,
            "hidden": hidden,
            "vocab": vocab,
            "dtype": args.dtype,
            "logits_gib": round(tokens * vocab * dtype.itemsize / GIB, 3),
            "grads_gib": round((tokens + vocab) * hidden * dtype.itemsize / GIB, 3),
            "methods": {},
            "forward_only": {},
        }
        results.append(row)
        inputs = make_inputs(tokens, hidden, vocab, dtype, device)
        steps = {m: make_step(m, args.temperature) for m in methods}
        # forward-only (no_grad) for the log-prob methods: old-policy / reference passes
        fwd = {m: forward_only(steps[m]) for m in methods if m in FORWARD_ONLY_METHODS}
        for key, these, run in (
            ("methods", steps, one_iteration),
            ("forward_only", fwd, one_forward),
        ):
            if args.device == "cpu":
                row[key] = cpu_measure(these, inputs, args.warmup, args.iters, run)
                continue
            for method, step in these.items():
                try:
                    row[key][method] = cuda_measure(step, inputs, args.warmup, args.iters, run)
                except torch.OutOfMemoryError:
                    row[key][method] = {"error": "out of memory"}
                # after the except block: its traceback no longer holds the failed step's tensors
                inputs[0].grad = inputs[1].grad = None
                torch.cuda.empty_cache()
        for m in row["methods"].values():
            if "peak_extra_gib" in m:  # what a method adds beyond the two gradients
                m["beyond_grads_gib"] = round(m["peak_extra_gib"] - row["grads_gib"], 3)
        logger.info("%s", json.dumps(row))
        del inputs
        if args.device == "cuda":
            torch.cuda.empty_cache()
    table = {
        "environment": run_environment(("liger-kernel", "triton")),
        "device": args.device,
        "temperature": args.temperature,
        "skipped": skipped,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
