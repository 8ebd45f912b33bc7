"""Time and peak extra memory of the LM head + per-token log-probs, forward + backward.

Methods, each from the final hidden states ``[T, H]`` and the head's weight ``[V, H]`` to the
gradients of both under random per-token upstream gradients:

- ``matmul_kernel``: ``logits = hidden @ weight.T`` (cuBLAS) + `logprobs_from_logits` (today's
  Triton kernels), issue #19's (a);
- ``matmul_naive``: the same matmul + ``log_softmax(logits.float()).gather`` (the naive form);
- ``fused``: `logprobs_from_hidden` (vocabulary chunks, no ``[T, V]`` logits), issue #19's (b);
- ``head_loss``: `unirl.core.maths.head_loss.head_loss`, the loss inside the head (token chunks,
  three matmuls, the gradients made in the forward; issue #30), its default chunk; with
  ``--head-loss-chunks 256,512`` also ``head_loss@256`` ... at those token chunks; variants of it
  by name in ``--methods``: ``head_loss+overlap`` (the weight-gradient addmm on a side stream
  beside the hidden-gradient matmul), ``head_loss+pipeline`` (both gradient matmuls of a chunk on
  a side stream while the next chunk's logits are made in a second buffer: twice the chunk's
  memory), ``head_loss+dwfp32`` (the weight gradient summed over chunks in fp32),
  ``head_loss+graph`` (the loss's per-chunk gradient call replayed as a CUDA graph), combined and
  with a chunk as ``head_loss_ppo+pipeline+graph@512``;
- ``liger``: liger-kernel's ``LigerFusedLinearCrossEntropyLoss`` (mean cross-entropy: no
  per-token upstream gradient, no entropy, no temperature), issue #19's (c); recorded as skipped
  when liger-kernel is not importable;
- with ``--entropy``: ``matmul_kernel_entropy``, ``fused_entropy`` and ``head_loss_entropy``,
  log-probs and entropy with both gradients (an entropy bonus);
- with ``--ppo``: ``matmul_kernel_ppo``, ``fused_ppo`` and ``head_loss_ppo``, the objective being
  core's `compute_loss` (PPO-clip, token-mean, entropy bonus 0.01: what a training step runs;
  ``head_loss_ppo`` calls it once per token chunk for the gradient, which this measures).

Every method but ``liger`` and ``*_ppo`` has the same objective,
``sum_t w_logp[t] logp_t (+ w_ent[t] H_t)`` with random per-token weights.

With ``--check`` each method's loss and gradients are also compared with those of the logits path
of the same objective (``matmul_kernel``, ``matmul_kernel_entropy`` or ``matmul_kernel_ppo``) on
the same inputs: ``correctness`` holds the absolute loss difference and the max-abs and relative
(norm) differences of both gradients.

Times are medians over ``--iters`` timed iterations after ``--warmup``: CUDA events on a GPU;
on the CPU ``perf_counter`` with the methods interleaved round by round (an in-process A/B that
a busy machine slows alike). Memory (CUDA only) is ``max_memory_allocated`` during one
iteration minus what was allocated before it (the inputs); it includes the gradients of the
hidden states and the weight, which every method makes. ``logits_gib`` is the ``[T, V]`` logits
in the compute dtype, for scale; ``beyond_grads_gib`` is the peak minus the two gradients
(``grads_gib``), what a method holds besides them. With ``--chunk-matmuls 256,1024,...``
(CUDA) each row also times the three head matmuls alone at those token chunks
(``chunk_matmuls``: the loss-in-head's floor at each chunk, scaled to the batch).
``forward_only`` times ``matmul_kernel`` and ``fused`` under ``no_grad`` (the old-policy and
reference passes).

    PYTHONPATH=$PWD python benchmarks/fused_head.py --device cuda \\
        --out benchmarks/results/fused_head/<date>_h200_<commit>.json
    PYTHONPATH=$PWD python benchmarks/fused_head.py --device cuda --tokens 16384 --hidden 1536 \\
        --methods matmul_kernel,liger,head_loss,head_loss+overlap,head_loss@2048 --check \\
        --out /tmp/fused_head_variants.json
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
from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.head_loss import default_token_chunk, head_loss
from unirl.core.maths.logprobs import logprobs_from_logits
from unirl.core.maths.logprobs_hidden import logprobs_from_hidden
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss

logger = logging.getLogger("fused_head")

GIB = 1 << 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("matmul_kernel", "matmul_naive", "fused", "head_loss", "liger")
ENTROPY_METHODS = ("matmul_kernel_entropy", "fused_entropy", "head_loss_entropy")
PPO_METHODS = ("matmul_kernel_ppo", "fused_ppo", "head_loss_ppo")
FORWARD_ONLY_METHODS = ("matmul_kernel", "fused")
PPO_SETTINGS = LossSettings(policy_loss="ppo_clip", entropy_coef=0.01)

# One iteration: (hidden, weight, targets, w_logp, w_ent, ppo) -> the scalar whose backward is
# timed; ``ppo`` holds the per-token data of core's loss.
Step = Callable[..., torch.Tensor]


def _weights_loss(w_logp: torch.Tensor, w_ent: torch.Tensor, entropy: bool) -> Callable:
    """The per-token-weights objective as a loss callable (for head_loss)."""

    def loss(logp: torch.Tensor, ent: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        value = (w_logp * logp).sum()
        return (value + (w_ent * ent).sum() if entropy else value), {}

    return loss


def _ppo_loss(ppo: dict[str, Any]) -> Callable:
    """Core's compute_loss on this microbatch, as a backend's loss_fn with its microbatch bound."""

    def loss(logp: torch.Tensor, ent: torch.Tensor | None) -> tuple[torch.Tensor, dict]:
        inp = LossInputs(
            logprobs=logp,
            old_logprobs=ppo["old"],
            advantages=ppo["adv"],
            loss_mask=ppo["mask"],
            seq_ids=ppo["seq_ids"],
            num_seqs=ppo["num_seqs"],
            seq_token_counts=ppo["seq_counts"],
            entropy=ent,
        )
        out = compute_loss(inp, ppo["counts"], PPO_SETTINGS, validate=False)
        return out.loss, out.metrics

    return loss


def _liger_loss() -> Any:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    return LigerFusedLinearCrossEntropyLoss()


HEAD_LOSS_FLAGS = ("overlap", "pipeline", "dwfp32", "graph")


def make_step(method: str, temperature: float) -> Step:
    spec, _, chunk_text = method.partition("@")
    chunk = int(chunk_text) if chunk_text else None
    base, *flags = spec.split("+")
    if flags and (not base.startswith("head_loss") or set(flags) - set(HEAD_LOSS_FLAGS)):
        raise ValueError(f"method {method!r}: only head_loss takes +{'/+'.join(HEAD_LOSS_FLAGS)}")
    entropy = base.endswith("_entropy") or base.endswith("_ppo")
    ppo = base.endswith("_ppo")
    kind = base.removesuffix("_entropy").removesuffix("_ppo")

    def objective(logp, ent, w_logp, w_ent, data):
        if ppo:
            return _ppo_loss(data)(logp, ent)[0]
        return _weights_loss(w_logp, w_ent, entropy)(logp, ent)[0]

    if kind == "matmul_kernel":

        def matmul_kernel(h, w, t, w_logp, w_ent, data):
            logits = h @ w.T
            if entropy:
                logp, ent = logprobs_from_logits(
                    logits, t, temperature=temperature, with_entropy=True
                )
                return objective(logp, ent, w_logp, w_ent, data)
            logp = logprobs_from_logits(logits, t, temperature=temperature)
            return objective(logp, None, w_logp, w_ent, data)

        return matmul_kernel
    if kind == "matmul_naive":

        def matmul_naive(h, w, t, w_logp, w_ent, data):
            logp_all = torch.log_softmax((h @ w.T).float() / temperature, dim=-1)
            return (w_logp * logp_all.gather(1, t[:, None]).squeeze(1)).sum()

        return matmul_naive
    if kind == "fused":

        def fused(h, w, t, w_logp, w_ent, data):
            if entropy:
                logp, ent = logprobs_from_hidden(
                    h, w, t, temperature=temperature, with_entropy=True
                )
                return objective(logp, ent, w_logp, w_ent, data)
            logp = logprobs_from_hidden(h, w, t, temperature=temperature)
            return objective(logp, None, w_logp, w_ent, data)

        return fused
    if kind == "head_loss":

        def in_head(h, w, t, w_logp, w_ent, data):
            loss = _ppo_loss(data) if ppo else _weights_loss(w_logp, w_ent, entropy)
            return head_loss(
                h,
                w,
                t,
                loss,
                temperature=temperature,
                with_entropy=entropy,
                chunk_size=chunk,
                overlap=(
                    "pipeline" if "pipeline" in flags else ("dw" if "overlap" in flags else "none")
                ),
                dweight_fp32="dwfp32" in flags,
                graph_loss="graph" in flags,
            ).loss

        return in_head
    if kind == "liger":
        loss = _liger_loss()
        return lambda h, w, t, w_logp, w_ent, data: loss(w, h, t)
    valid = METHODS + ENTROPY_METHODS + PPO_METHODS
    raise ValueError(
        f"unknown method {method!r}; valid: {valid}, "
        "head_loss[+overlap|+pipeline][+dwfp32][+graph][@<chunk>]"
    )


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
    # core's loss: 512-token sequences, 90% of the tokens valid, old log-probs near a 152k-way
    # uniform policy's, so that some ratios clip
    seq_ids = torch.arange(tokens, device=device) // 512
    num_seqs = int(seq_ids[-1]) + 1 if tokens else 0
    mask = (torch.rand(tokens, generator=g, device=device) > 0.1).float()
    ppo = {
        "old": torch.randn(tokens, generator=g, device=device) - 12.0,
        "adv": torch.randn(tokens, generator=g, device=device),
        "mask": mask,
        "seq_ids": seq_ids,
        "num_seqs": num_seqs,
        "seq_counts": torch.zeros(num_seqs, device=device).index_add(0, seq_ids, mask).long(),
        "counts": GlobalCounts(tokens=int(mask.sum()), sequences=num_seqs),
    }
    return h, w, t, w_logp, w_ent, ppo


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


def reference_method(method: str) -> str | None:
    """The logits path with ``method``'s objective (None: liger, whose objective differs, and the
    references themselves)."""
    base = method.partition("@")[0].split("+")[0]
    if base.startswith("matmul_kernel") or base.startswith("liger"):
        return None
    if base == "matmul_naive":
        return "matmul_kernel"
    suffix = "_ppo" if base.endswith("_ppo") else ("_entropy" if base.endswith("_entropy") else "")
    return "matmul_kernel" + suffix


def _loss_and_grads(step: Step, inputs: tuple) -> tuple[float, torch.Tensor, torch.Tensor]:
    h, w = inputs[0], inputs[1]
    h.grad = w.grad = None
    loss = step(*inputs)
    loss.backward()
    out = float(loss.detach()), h.grad, w.grad
    h.grad = w.grad = None
    return out


def check_against_logits(
    methods: list[str], temperature: float, inputs: tuple
) -> dict[str, dict[str, float]]:
    """Each method's loss and gradients against the logits path of the same objective."""
    found: dict[str, dict[str, float]] = {}
    for ref_name in sorted({r for m in methods if (r := reference_method(m)) is not None}):
        ref_loss, ref_h, ref_w = _loss_and_grads(make_step(ref_name, temperature), inputs)
        for method in [m for m in methods if reference_method(m) == ref_name]:
            try:
                loss, dh, dw = _loss_and_grads(make_step(method, temperature), inputs)
            except torch.OutOfMemoryError:
                found[method] = {"error": "out of memory"}
                continue
            except Exception as err:  # one variant's failure must not end a sweep
                logger.exception("check of %s failed", method)
                found[method] = {"error": repr(err)}
                continue
            found[method] = {"reference": ref_name, "loss_abs_diff": abs(loss - ref_loss)}
            for key, got, ref in (("dh", dh, ref_h), ("dw", dw, ref_w)):
                diff = (got.float() - ref.float()).abs()
                found[method][f"{key}_max_abs_diff"] = float(diff.max())
                found[method][f"{key}_rel_diff"] = float(
                    (got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
                )
                found[method][f"{key}_ref_max_abs"] = float(ref.float().abs().max())
            del dh, dw
        del ref_h, ref_w
    return found


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


def _timed(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _chunk_row(
    h: torch.Tensor, w: torch.Tensor, chunk: int, warmup: int, iters: int
) -> dict[str, float]:
    hc = h[:chunk].contiguous()
    z = torch.empty(chunk, w.shape[0], dtype=h.dtype, device=h.device)
    dh, dw = torch.empty_like(hc), torch.zeros_like(w)
    row = {
        "logits_ms": _timed(lambda: torch.mm(hc, w.T, out=z), warmup, iters),
        "dhidden_ms": _timed(lambda: torch.mm(z, w, out=dh), warmup, iters),
        "dweight_addmm_ms": _timed(lambda: dw.addmm_(z.T, hc), warmup, iters),
    }
    row["per_batch_ms"] = sum(row.values()) * h.shape[0] / chunk
    row["chunk_logits_gib"] = z.numel() * z.element_size() / GIB
    return {k: round(v, 4) for k, v in row.items()}


def chunk_matmuls(
    inputs: tuple, chunks: list[int], warmup: int, iters: int
) -> dict[str, dict[str, float]]:
    """The three head matmuls alone at each token chunk, CUDA-event timed, and their sum scaled
    to the whole batch (``per_batch_ms``): the floor of the loss inside the head at that chunk
    (the logits ``[C, H] x [H, V]`` into one buffer, ``d(hidden) = dz [C, V] x [V, H]``, and the
    weight gradient's ``addmm`` into ``[V, H]``, which reads and writes the whole gradient per
    chunk), and the chunk's logits bytes."""
    h, w = inputs[0].detach(), inputs[1].detach()
    out = {}
    for chunk in chunks:
        if chunk <= h.shape[0]:
            out[str(chunk)] = _chunk_row(h, w, chunk, warmup, iters)
            torch.cuda.empty_cache()
    return out


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
    parser.add_argument("--ppo", action="store_true", help="also " + ", ".join(PPO_METHODS))
    parser.add_argument(
        "--head-loss-chunks",
        default="",
        help="token chunks (e.g. 256,512,1024,2048): also head_loss@<chunk> for each",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="also compare each method's loss and gradients with the logits path's",
    )
    parser.add_argument(
        "--chunk-matmuls",
        default="",
        help="CUDA: token chunks (e.g. 256,1024,16384) at which to time the three head matmuls "
        "alone, the loss-in-head's floor at that chunk (row's chunk_matmuls)",
    )
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
    if args.ppo:
        methods += list(PPO_METHODS)
    methods += [f"head_loss@{c}" for c in args.head_loss_chunks.split(",") if c]
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
            "head_loss_chunk": min(tokens, default_token_chunk(vocab, device, dtype, tokens)),
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
                except Exception as err:  # one variant's failure: recorded
                    logger.exception("%s failed", method)
                    row[key][method] = {"error": repr(err)}
                # after the except block: its traceback no longer holds the failed step's tensors
                inputs[0].grad = inputs[1].grad = None
                torch.cuda.empty_cache()
        if args.check:
            row["correctness"] = check_against_logits(methods, args.temperature, inputs)
        if args.chunk_matmuls and args.device == "cuda":
            row["chunk_matmuls"] = chunk_matmuls(
                inputs, ints(args.chunk_matmuls), args.warmup, args.iters
            )
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
