"""Megatron backend throughput: one RL training step of a Qwen2.5-shaped model on a rollout-like
packed batch, its model FLOPs utilisation, the actor phase with ``old_logprobs: reuse`` against
``recompute``, and unirl's overhead over a plain megatron-core training loop.

    PYTHONPATH=$PWD python benchmarks/megatron_throughput.py \\
        --out benchmarks/results/megatron_throughput/<date>_h200_<commit>_dense.json

(several GPUs: ``python -m torch.distributed.run --nproc_per_node 4 benchmarks/... --tp 2 --pp 2
--model qwen2.5-7b``). What is measured, all in one process group, on one model built once:

- **rollout batch**: ``--samples`` sequences with lengths drawn uniformly in ``[--min-len,
  --max-len]`` (seeded), a prompt of ``len // 8`` tokens and the rest response, random token ids
  and rewards; token-budget microbatches (``--tokens-per-microbatch``, balanced by length), one
  optimizer step per rollout (the on-policy case in which reuse is allowed).
- **reuse**: `RLStep.run` with ``old_logprobs: reuse``: the actor phase is the training pass
  alone (forward + backward of every microbatch + the optimizer step).
- **recompute**: the same with ``old_logprobs: recompute``: a forward-only pass first.
- **plain**: a plain megatron-core loop over the same packed microbatches (inputs built before
  the clock starts), the same model chunks, DDP, optimizer and schedule function, with
  megatron's own cross-entropy (``GPTModel(labels=...)``) in place of the RL loss; the overhead is
  ``unirl reuse step time / plain step time - 1``.

Model FLOPs (per real token, padding excluded): ``6 N`` for a training pass and ``2 N`` for a
forward-only pass, ``N`` the matmul parameters (attention and MLP projections of every layer and
the output layer; the embedding lookup is not a matmul), plus causal attention ``6 L d Σ s²``
(training) or ``2 L d Σ s²`` (forward), ``d`` = heads x head dim, ``s`` each sequence's length.
MFU = model FLOPs / (time x 989 TFLOP/s x GPUs), the H200's dense bf16 peak.

Mixture of experts (``--model qwen3-30b-a3b --layers 8``): ``N`` counts the active parameters
(router + top-k experts); ``--experts sequential | grouped`` forces megatron's `SequentialMLP` or
`GroupedExperts` (default: `select_experts`' choice), the issue's A/B::

    PYTHONPATH=$PWD python benchmarks/megatron_throughput.py --model qwen3-30b-a3b --layers 8 \
        --experts grouped --out benchmarks/results/megatron_throughput/<date>_h200_<commit>_moe-grouped.json

``--fused-head`` sets ``model.fused_head: true`` (log-probs from the last stage's hidden states and
the output layer's weight, no ``[T, V]`` logits); without it ``auto`` chooses from the logits'
bytes (`unirl.core.config.head_memory`). The plain loop computes megatron's own cross-entropy from
logits and does not run with the fused head.

Long sequences (issue 49): ``--model qwen3-4b`` / ``qwen3-0.6b``, one sequence of 65,536 tokens per
microbatch, megatron's activation recompute (``--recompute-activations`` whole layers, with
``--recompute-layers N`` the first N only; ``--recompute-modules mlp,layernorm`` selective)::

    PYTHONPATH=$PWD python benchmarks/megatron_throughput.py --model qwen3-4b --samples 2 \
        --group 2 --min-len 65536 --max-len 65536 --tokens-per-microbatch 65536 \
        --recompute-activations --modes reuse --steps 1 \
        --out benchmarks/results/megatron_throughput/<date>_h200_<commit>_qwen3-4b-64k.json

``--search-tokens 16384,24576,32768,...`` finds the largest token-budget microbatch that fits:
it runs the reuse step at each budget in turn (each rollout long enough for two full
microbatches, sequences of ``--min-len`` to ``--max-len`` tokens), records its time, MFU and peak
memory, and stops at the first out-of-memory (the backend is not usable after one; on several
GPUs every rank holds the same shapes and runs out alike)::

    PYTHONPATH=$PWD python benchmarks/megatron_throughput.py --fused-head \
        --search-tokens 16384,24576,32768,49152,65536,98304,131072 \
        --out benchmarks/results/megatron_throughput/<date>_h200_<commit>_search-fused-head.json

Times are medians over ``--steps`` timed steps after ``--warmup`` untimed ones, with CUDA
synchronised around each step. The model is randomly initialised (bf16 weights, fp32 optimizer
state): the step's speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.optimizer_timing import optimizer_steps_timed
from benchmarks.profile_gaps import add_profile_gaps_argument
from benchmarks.run_environment import run_environment

logger = logging.getLogger("megatron_throughput")

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16

MODELS: dict[str, dict[str, Any]] = {
    # Qwen2.5-1.5B's architecture (config.json of Qwen/Qwen2.5-1.5B)
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
    # Qwen2.5-7B's architecture
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
    },
    # Qwen3-4B's architecture (config.json of Qwen/Qwen3-4B: GQA 32 / 8 heads of 128 with q / k
    # RMSNorm, tied embeddings); max_position_embeddings raised from 40,960 to the 65,536-token
    # sequences of the long-sequence rows (issue 49; RoPE's position table only)
    "qwen3-4b": {
        "model_type": "qwen3",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 65536,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    # Qwen3-0.6B's architecture (config.json of Qwen/Qwen3-0.6B), the same raised position table
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 65536,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    # Qwen3-30B-A3B's architecture (config.json of Qwen/Qwen3-30B-A3B); the issue measures it at
    # --layers 8, EP = 1, --experts sequential | grouped
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
}


# -- FLOPs -------------------------------------------------------------------------------------


def _q_dim(hf: dict[str, Any]) -> int:
    """heads x head dim (the hidden size, unless the config sets ``head_dim``)."""
    heads = hf["num_attention_heads"]
    return heads * hf.get("head_dim", hf["hidden_size"] // heads)


def matmul_params(hf: dict[str, Any]) -> int:
    """Parameters that multiply activations: q, k, v, o, gate, up, down per layer + output layer.
    Mixture of experts: the active ones, the router and the top-k experts' gate, up and down
    (every layer sparse, as Qwen3-30B-A3B's)."""
    h, layers = hf["hidden_size"], hf["num_hidden_layers"]
    q = _q_dim(hf)
    kv = hf["num_key_value_heads"] * (q // hf["num_attention_heads"])
    if hf.get("num_experts"):
        mlp = (
            h * hf["num_experts"] + hf["num_experts_per_tok"] * 3 * h * hf["moe_intermediate_size"]
        )
    else:
        mlp = 3 * h * hf["intermediate_size"]
    per_layer = h * q + 2 * h * kv + q * h + mlp
    return layers * per_layer + h * hf["vocab_size"]


def model_flops(hf: dict[str, Any], lengths: list[int], *, training: bool) -> float:
    """Model FLOPs of one pass over sequences of ``lengths`` (module docstring)."""
    factor = 6 if training else 2
    tokens = sum(lengths)
    attention = hf["num_hidden_layers"] * _q_dim(hf) * sum(s * s for s in lengths)
    return factor * (matmul_params(hf) * tokens + attention)


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    """``--model`` with the ``--layers`` / ``--hidden`` overrides and a RoPE table as long as
    ``--max-len``."""
    hf = dict(MODELS[args.model])
    if args.layers is not None:
        hf["num_hidden_layers"] = args.layers
    # RoPE's position table long enough for --max-len (the longest-sequence rows)
    hf["max_position_embeddings"] = max(hf["max_position_embeddings"], args.max_len)
    if args.hidden is not None:  # smoke runs: a small model of the same family
        heads = hf["num_attention_heads"]
        hf.update(hidden_size=args.hidden, intermediate_size=4 * args.hidden)
        hf["num_attention_heads"] = heads if args.hidden % heads == 0 else 4
        hf["num_key_value_heads"] = min(hf["num_key_value_heads"], hf["num_attention_heads"])
        hf["vocab_size"] = 1024
    return hf


# -- the batch and the configs -----------------------------------------------------------------


def rollout_lengths(args: argparse.Namespace) -> list[int]:
    g = torch.Generator().manual_seed(args.seed)
    return torch.randint(args.min_len, args.max_len + 1, (args.samples,), generator=g).tolist()


def rollout_records(lengths: list[int], vocab: int, group: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 1)
    records = []
    for i, n in enumerate(lengths):
        prompt = max(1, n // 8)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        records.append(
            {
                "prompt_tokens": ids[:prompt],
                "response_tokens": ids[prompt:],
                "reward": float(torch.rand((), generator=g)),
                "group_id": i // group,
            }
        )
    return records


def config_dict(
    args: argparse.Namespace,
    hf: dict[str, Any],
    old_logprobs: str,
    *,
    samples: int | None = None,
    tokens_per_microbatch: int | None = None,
) -> dict:
    samples = samples or args.samples
    megatron: dict[str, Any] = {"attention": args.attention}
    # callers that build their own arguments (weight_transfer.py) may leave these out
    if getattr(args, "recompute_modules", ""):
        megatron["recompute_modules"] = args.recompute_modules.split(",")
    if getattr(args, "recompute_layers", None) is not None:
        megatron["recompute_layers"] = args.recompute_layers
    model: dict[str, Any] = {}
    if getattr(args, "lora_rank", 0):
        # LoRA on every linear of the decoder (the rows); MFU still counts the model's
        # 6 * N * tokens, as full fine-tuning's rows do (the adapter's own FLOPs are not added)
        model["lora"] = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}
    return {
        "backend": "megatron",
        "old_logprobs": old_logprobs,
        "megatron": megatron,
        "model": {
            "hf_config": hf,
            "init_seed": 0,
            # the CPU dry runs (--device cpu): fp32, megatron's CPU path (unirl cpu_compat)
            "dtype": getattr(args, "dtype", "bf16"),
            "max_seq_len": args.max_len,
            "gradient_checkpointing": args.recompute_activations,
            # --keep-attention: the recomputed layers keep attention's output (unirl.backends.
            # kept_attention); its forward runs once
            "recompute_attention": not getattr(args, "keep_attention", False),
            # auto: the loss inside the head when the logits would exceed the budget
            "fused_head": True if args.fused_head else "auto",
            **model,
        },
        # auto: offloaded when weights + gradients + optimizer state exceed 0.8 of the GPU
        # (`unirl.core.config.optimizer_offload`); --optimizer-offload none | cpu forces it
        "optimizer": {
            "lr": 1e-6,
            "grad_clip": 1.0,
            "offload": getattr(args, "optimizer_offload", "auto"),
        },
        "batch": {
            "prompts_per_rollout": samples // args.group,
            "samples_per_prompt": args.group,
            "samples_per_optimizer_step": samples,  # one optimizer step: on-policy
            "max_tokens_per_microbatch": tokens_per_microbatch or args.tokens_per_microbatch,
        },
        "parallel": {
            "tp": args.tp,
            "pp": args.pp,
            "vpp": args.vpp,
            "cp": args.cp,
            "zero_stage": 1,
        },
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip"},
        "train": {"seed": 0},
        "progress": {"enabled": True},
        "logging": {"run_dir": tempfile.mkdtemp(prefix="unirl-throughput-"), "tensorboard": False},
    }


# -- timing ------------------------------------------------------------------------------------


def sync() -> None:
    """Wait for the GPU (nothing to wait for on the CPU dry runs)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib() -> float | None:
    """The GPU's peak allocated memory since the last reset; None on the CPU."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def allocated_gib() -> float | None:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None


def host_peak_rss_gib() -> float:
    """This process's peak resident host memory (the offloaded optimizer state lives there)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_plan(cfg: Any) -> dict[str, Any]:
    """What `unirl check` decides about memory for ``cfg``: the LM head and the optimizer state,
    each with its reason."""
    from unirl.core.config.derived import head_path
    from unirl.core.config.optimizer_offload import choose_optimizer_offload

    offload = choose_optimizer_offload(cfg)
    return {
        "head": head_path(cfg).reason,
        "optimizer_offload": offload.offload,
        "optimizer_state": offload.reason,
    }


PROFILE: dict[str, Any] = {"dir": None}


def profiled(fn: Any, name: str) -> None:
    """One more step under torch.profiler (``--profile-dir``): kernel and CPU tables."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table = prof.key_averages()
    # GPU busy share: kernel time of the step against its wall time (idle gaps are host-bound)
    kernels = sum(e.self_device_time_total for e in table if e.device_type.name == "CUDA") / 1e6
    text = (
        f"step wall {wall:.3f} s, kernel time {kernels:.3f} s ({100 * kernels / wall:.1f}% busy)\n"
    )
    text += table.table(sort_by="cuda_time_total", row_limit=60)
    text += "\n\n" + table.table(sort_by="cpu_time_total", row_limit=45)
    out = Path(PROFILE["dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{name}.txt").write_text(text)
    if PROFILE.get("trace"):
        prof.export_chrome_trace(str(out / f"trace_{name}.json"))
    if PROFILE.get("gaps"):
        from benchmarks.profile_gaps import profile_with_gaps

        profile_with_gaps(fn, out, name, with_stack=PROFILE["gaps"] == "stack")


def timed(fn: Any, warmup: int, steps: int) -> tuple[list[float], Any]:
    last = None
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        last = fn()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, last


def run_rl_steps(cfg: Any, backend: Any, batch: Any, args: argparse.Namespace) -> dict[str, Any]:
    from unirl.core.step import RLStep

    step = RLStep(cfg, backend)
    phases: list[dict[str, float]] = []
    optimizer_s: list[float] = []  # per RL step: its optimizer steps' time

    with optimizer_steps_timed(backend, sync) as optimizer:

        def one() -> Any:
            mark = optimizer.mark()
            result = step.run(batch)
            phases.append(result.metrics)
            optimizer_s.append(optimizer.since(mark))
            return result

        times, result = timed(one, args.warmup, args.steps)
    timed_phases = phases[args.warmup : args.warmup + args.steps]
    timed_optimizer = optimizer_s[args.warmup : args.warmup + args.steps]
    if PROFILE["dir"]:
        profiled(lambda: step.run(batch), cfg.old_logprobs)
    actor = [m.get("time/actor_forward_s", 0.0) + m["time/train_s"] for m in timed_phases]
    return {
        "step_s": times,
        "actor_phase_s": actor,
        "actor_forward_s": [m.get("time/actor_forward_s", 0.0) for m in timed_phases],
        "train_s": [m["time/train_s"] for m in timed_phases],
        # the optimizer step alone (with the state offloaded: the host's Adam step and copies)
        "optimizer_s": timed_optimizer,
        "old_logprob_source": result.decision.source,
        "loss": result.metrics.get("loss"),
        "grad_norm": result.metrics.get("grad_norm"),
    }


def _labels(item: Any) -> torch.Tensor:
    """Next-token labels in the model input's shape (0 where the input is padding)."""
    shape = item.batch.model_kwargs()["input_ids"].shape
    flat = torch.zeros(shape.numel(), dtype=torch.long, device=item.mb.targets.device)
    index = getattr(item.batch, "flat_index", None)
    if index is None:  # packed: the real tokens come first
        index = torch.arange(item.batch.real_tokens, device=flat.device)
    flat[index] = item.mb.targets
    return flat.view(shape)


def plain_megatron_steps(backend: Any, cfg: Any, batch: Any, args: argparse.Namespace) -> dict:
    """The same packed microbatches through megatron-core alone: GPTModel's own cross-entropy,
    the schedule function, DDP and the optimizer (module docstring)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from unirl.backends.megatron.schedule import schedule_items
    from unirl.core.step import RLStep

    topo = backend.topology
    step = RLStep(cfg, backend)
    (plan,) = step._plans(batch, 0)
    (opt_step,) = plan.steps
    packs = [batch.pack(idx) for idx in opt_step.microbatches(topo.dp_rank)]
    mbs = [step._microbatch(p, None, None, None) for p in packs]
    items, rows, seq_len = schedule_items(
        mbs,
        topo,
        backend.device,
        packed=backend.loop.packed,
        seq_multiple=backend.loop.seq_multiple,
    )
    labels = [None if it.is_pad else _labels(it) for it in items]  # VPP pads: no labels
    total_valid = sum(float(it.mb.loss_mask.sum()) for it in items if not it.is_pad)
    n = len(items)
    ddp, optimizer = backend.policy.ddp, backend.policy.optimizer
    vpp = len(ddp) > 1

    def forward_step(data_iterator: Any, model: Any) -> Any:
        i = next(data_iterator)
        item = items[i]
        # per-token fp32 cross-entropy [rows, L] on the last stage (hidden states elsewhere)
        per_token = model(**item.batch.model_kwargs(), labels=labels[i])

        def loss_func(output: torch.Tensor) -> Any:
            if item.is_pad:  # a zero that still reaches every parameter
                return output.sum() * 0.0, {}
            ce = item.batch.real_logits(output[..., None])[:, 0]  # the real tokens' entries
            loss = (ce * item.mb.loss_mask).sum() / total_valid
            return loss * n * topo.dp_size, {}  # cancel megatron's mean (as unirl does)

        return per_token, loss_func

    def one() -> None:
        iterators = [iter(range(n)) for _ in ddp]
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if vpp else iterators[0],
            model=list(ddp) if vpp else ddp[0],
            num_microbatches=n,
            seq_length=seq_len,
            micro_batch_size=rows,
            forward_only=False,
        )
        optimizer.step()
        for chunk in ddp:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()

    times, _ = timed(one, args.warmup, args.steps)
    if PROFILE["dir"]:
        profiled(one, "plain")
    return {"step_s": times}


# -- the driver --------------------------------------------------------------------------------


def search_tokens(
    args: argparse.Namespace, hf: dict[str, Any], backend: Any, gpus: int
) -> dict[str, Any]:
    """The reuse step at each budget of ``--search-tokens`` in turn, up to the first OOM."""
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch

    rows: list[dict[str, Any]] = []
    largest = None
    mean_len = (args.min_len + args.max_len) / 2
    for budget in [int(x) for x in args.search_tokens.split(",") if x]:
        # two full microbatches per data-parallel rank, in whole groups
        dp = backend.topology.dp_size
        samples = max(args.group, int(2 * budget * dp / mean_len) // args.group * args.group)
        search_args = argparse.Namespace(**{**vars(args), "samples": samples})
        lengths = rollout_lengths(search_args)
        batch = RolloutBatch.from_records(rollout_records(lengths, hf["vocab_size"], args.group, 0))
        cfg = config_from_dict(
            config_dict(args, hf, "reuse", samples=samples, tokens_per_microbatch=budget)
        )
        row: dict[str, Any] = {"tokens_per_microbatch": budget, "samples": samples}
        rows.append(row)
        reset_peak_memory()
        try:
            res = run_rl_steps(cfg, backend, batch, args)
        except torch.OutOfMemoryError as err:
            row["fits"] = False
            row["error"] = str(err).splitlines()[0][:300]
            logger.info("%d tokens per microbatch: out of memory", budget)
            break
        row["fits"] = True
        row["peak_memory_gib"] = peak_memory_gib()
        row["tokens"] = sum(lengths)
        row["summary"] = summary(hf, lengths, res, gpus)
        largest = budget
        logger.info("%d tokens per microbatch: %s", budget, json.dumps(row["summary"]))
    return {"largest_fitting_tokens_per_microbatch": largest, "budgets": rows}


def summary(
    hf: dict[str, Any], lengths: list[int], res: dict[str, Any], gpus: int
) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in res.items() if isinstance(v, list) and v}
    tokens = sum(lengths)
    train_flops = model_flops(hf, lengths, training=True)
    fwd_flops = model_flops(hf, lengths, training=False)
    out: dict[str, Any] = {"median_s": med}
    if "train_s" in med:
        out["train_tokens_per_s"] = tokens / med["train_s"]
        out["train_mfu"] = train_flops / (med["train_s"] * PEAK_BF16_FLOPS * gpus)
    if "actor_phase_s" in med:
        recomputes = med.get("actor_forward_s", 0.0) > 0
        flops = train_flops + (fwd_flops if recomputes else 0.0)
        out["actor_phase_tokens_per_s"] = tokens / med["actor_phase_s"]
        out["actor_phase_mfu"] = flops / (med["actor_phase_s"] * PEAK_BF16_FLOPS * gpus)
    if "step_s" in med:
        out["step_tokens_per_s"] = tokens / med["step_s"]
        out["step_mfu_training_flops"] = train_flops / (med["step_s"] * PEAK_BF16_FLOPS * gpus)
    return out


def wgrad_fusion_state() -> bool | None:
    """Whether the model's linear layers accumulate weight gradients fused (after the build)."""
    from unirl.backends.megatron.kernels import wgrad_fusion

    return wgrad_fusion._state["installed"]


# reuse with long sequences' attention on cuDNN or on flash (UNIRL_CUDNN_ATTENTION's value)
_ATTENTION_MODES = {"reuse-cudnn": "1", "reuse-flash": "0"}


@contextlib.contextmanager
def _attention_env(value: str) -> Iterator[None]:
    before = os.environ.get("UNIRL_CUDNN_ATTENTION")
    os.environ["UNIRL_CUDNN_ATTENTION"] = value
    try:
        yield
    finally:
        os.environ.pop("UNIRL_CUDNN_ATTENTION")
        if before is not None:
            os.environ["UNIRL_CUDNN_ATTENTION"] = before


def cudnn_attention_state() -> str:
    """Which kernel long sequences' attention runs on (``UNIRL_CUDNN_ATTENTION=0``: flash)."""
    from unirl.backends import cudnn_attention

    if not cudnn_attention.enabled():
        return "flash varlen (UNIRL_CUDNN_ATTENTION=0)"
    return f"cuDNN for sequences >= {cudnn_attention.MIN_LONGEST} tokens, if its probe passes"


def triton_fusions_state() -> str:
    """``"on"`` or ``"off: <why>"`` for the Triton RoPE / SwiGLU kernels (after the build)."""
    from unirl.backends.megatron.kernels import gpu_fusions

    return gpu_fusions.status()


def add_recompute_arguments(parser: argparse.ArgumentParser) -> None:
    """Megatron's activation recompute beyond ``--recompute-activations`` (whole layers)."""
    parser.add_argument(
        "--recompute-modules",
        default="",
        help="megatron.recompute_modules: selective recompute of these layer parts, e.g. mlp,layernorm",
    )
    parser.add_argument(
        "--recompute-layers",
        type=int,
        default=None,
        help="megatron.recompute_layers: with --recompute-activations, only the first N layers",
    )
    parser.add_argument(
        "--keep-attention",
        action="store_true",
        help="model.recompute_attention: false: with --recompute-activations the recomputed "
        "layers keep attention's output and run only the rest again",
    )


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="model.lora on every decoder linear with this rank (alpha 2 x rank); 0: full "
        "fine-tuning",
    )


def add_offload_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizer-offload",
        choices=["auto", "none", "cpu"],
        default="auto",
        help="optimizer.offload: the optimizer state in host memory (auto: when weights + "
        "gradients + state exceed 0.8 of the GPU's memory)",
    )


def recompute_summary(args: argparse.Namespace) -> str:
    if args.recompute_activations:
        n = args.recompute_layers
        which = "full, every layer" if n is None else f"full, the first {n} layers (block)"
        return which + (", attention kept" if args.keep_attention else "")
    if args.recompute_modules:
        return f"selective: {args.recompute_modules}"
    return "none"


def force_experts(choice: str) -> str:
    """``--experts``: leave `select_experts` to decide (auto) or make the MoE layers' spec use
    one module for this A/B (a benchmark-only override of
    `unirl.backends.megatron.model.experts_choice`; both modules hold the same parameters)."""
    if choice == "auto":
        return "auto"
    from megatron.core.transformer.moe.experts import SequentialMLP

    from unirl.backends.megatron import model
    from unirl.backends.megatron.moe.grouped_experts import ExpertsChoice, GroupedExperts

    forced = ExpertsChoice(
        module=SequentialMLP if choice == "sequential" else GroupedExperts,
        name=choice,
        reason="forced by benchmarks/megatron_throughput.py --experts",
    )
    model.experts_choice = lambda device, config, requested="auto": forced
    return choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=None, help="override (smoke runs)")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke runs)")
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: a dry run of the plumbing (fp32, gloo, megatron's CPU path; tiny shapes)",
    )
    add_offload_argument(parser)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--tokens-per-microbatch", type=int, default=16384)
    parser.add_argument("--attention", default="packed", choices=["packed", "padded", "unfused"])
    parser.add_argument("--recompute-activations", action="store_true")
    add_recompute_arguments(parser)
    parser.add_argument(
        "--modes",
        default="reuse,recompute,plain",
        help="reuse, recompute, plain; reuse-cudnn / reuse-flash: reuse with long sequences' "
        "attention on cuDNN / on flash (in one process: the A/B)",
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-dir", type=Path, default=None, help="profile one more step")
    parser.add_argument(
        "--profile-trace", action="store_true", help="--profile-dir: also a chrome trace"
    )
    add_profile_gaps_argument(parser)
    parser.add_argument(
        "--fused-head",
        action="store_true",
        help="model.fused_head: true, no logits; PPO-clip's loss inside the head (3 head "
        "matmuls). Without it: auto, fused when the logits + gradient exceed 10 GiB",
    )
    parser.add_argument(
        "--experts",
        choices=["auto", "sequential", "grouped"],
        default="auto",
        help="MoE models: the experts module (auto: select_experts' choice, grouped on CUDA)",
    )
    parser.add_argument(
        "--no-wgrad-fusion",
        action="store_true",
        help="A/B: megatron's unfused weight-gradient accumulation (bf16 grad, then DDP's add)",
    )
    add_lora_argument(parser)
    parser.add_argument(
        "--search-tokens",
        default="",
        help="comma-separated microbatch token budgets: the largest that fits (reuse step)",
    )
    args = parser.parse_args()
    args.dtype = "fp32" if args.device == "cpu" else "bf16"  # megatron on the CPU: fp32 only
    if args.fused_head and "plain" in args.modes.split(",") and not args.search_tokens:
        parser.error(
            "--fused-head: the plain megatron-core loop computes its cross-entropy from logits; "
            "pass --modes reuse,recompute"
        )
    if args.lora_rank and "plain" in args.modes.split(","):
        parser.error("--lora-rank: the plain megatron-core loop has no adapters; --modes reuse")
    PROFILE["dir"] = args.profile_dir
    PROFILE["trace"] = args.profile_trace
    PROFILE["gaps"] = args.profile_gaps
    # host ops here are small: many intra-op threads only contend with the thread that
    # launches the GPU work (torchrun sets 1 per process for the same reason)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(8, os.cpu_count() or 1))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from unirl.backends import build_backend
    from unirl.core.config.derived import fused_head, head_path
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch

    experts = force_experts(args.experts)
    if args.no_wgrad_fusion:
        from unirl.backends.megatron.kernels import wgrad_fusion

        wgrad_fusion._state["installed"] = False
    hf = model_shape(args)
    lengths = rollout_lengths(args)
    batch = RolloutBatch.from_records(rollout_records(lengths, hf["vocab_size"], args.group, 0))
    cfgs = {mode: config_from_dict(config_dict(args, hf, mode)) for mode in ("reuse", "recompute")}
    t0 = time.perf_counter()
    backend = build_backend(cfgs["reuse"], total_optimizer_steps=1000, needs_reference=False)
    build_s = time.perf_counter() - t0
    gpus = backend.topology.world_size
    built_gib = allocated_gib()
    if fused_head(cfgs["reuse"]) and "plain" in args.modes.split(","):
        # the plain loop takes megatron's cross-entropy from logits, which the fused head omits
        logger.info("model.fused_head: auto chose the fused head: no plain megatron-core mode")
        args.modes = ",".join(m for m in args.modes.split(",") if m != "plain")
    report: dict[str, Any] = {
        "environment": {
            **run_environment(),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "torch_threads": torch.get_num_threads(),
        },
        "model": {
            "name": args.model,
            **hf,
            "matmul_params": matmul_params(hf),
            "experts": experts,
        },
        "batch": {
            "samples": len(lengths),
            "tokens": sum(lengths),
            "min_len": min(lengths),
            "max_len": max(lengths),
            "tokens_per_microbatch": args.tokens_per_microbatch,
            "attention": args.attention,
            # sequences of >= MIN_LONGEST tokens on cuDNN (unirl.backends.cudnn_attention)
            "cudnn_attention": cudnn_attention_state(),
            "activation_recompute": args.recompute_activations,
            "fused_head": fused_head(cfgs["reuse"]),
            "recompute": recompute_summary(args),
            "wgrad_fusion": bool(wgrad_fusion_state()),
            # Triton packed RoPE + SwiGLU backward (unirl.backends.megatron.kernels.gpu_fusions)
            "triton_fusions": triton_fusions_state(),
            # the training forward's head path (`unirl check`): with --fused-head, PPO-clip's
            # loss inside the head (3 head matmuls)
            "head_path": head_path(cfgs["reuse"]).reason,
            # optimizer.offload (--optimizer-offload): where the optimizer state lives, and why
            "optimizer_offload": memory_plan(cfgs["reuse"])["optimizer_offload"],
        },
        # `unirl check`'s decisions on memory for this config (head, optimizer state)
        "memory_plan": memory_plan(cfgs["reuse"]),
        "parallel": {"tp": args.tp, "pp": args.pp, "vpp": args.vpp, "cp": args.cp, "gpus": gpus},
        "flops": {
            "train_pass": model_flops(hf, lengths, training=True),
            "forward_pass": model_flops(hf, lengths, training=False),
            "peak_per_gpu": PEAK_BF16_FLOPS,
        },
        "build_s": build_s,
        # weights, gradient buffers (and nothing of the optimizer yet: its state is made lazily)
        "memory_after_build_gib": built_gib,
        "results": {},
    }
    results = report["results"]
    if args.search_tokens:
        report["search"] = search_tokens(args, hf, backend, gpus)
        if backend.topology.rank == 0:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
            logger.info("largest: %s", report["search"]["largest_fitting_tokens_per_microbatch"])
        if report["search"]["budgets"][-1]["fits"]:
            backend.close()  # after an out-of-memory it is left as it is: the process ends
        return
    for mode in [m for m in args.modes.split(",") if m]:
        logger.info("mode %s", mode)
        reset_peak_memory()
        if mode == "plain":
            res = plain_megatron_steps(backend, cfgs["reuse"], batch, args)
        elif mode in _ATTENTION_MODES:  # the same steps, long sequences' attention chosen
            with _attention_env(_ATTENTION_MODES[mode]):
                res = run_rl_steps(cfgs["reuse"], backend, batch, args)
        else:
            res = run_rl_steps(cfgs[mode], backend, batch, args)
        res["peak_memory_gib"] = peak_memory_gib()
        # between steps: weights + gradient buffers + optimizer state (on the GPU unless
        # offloaded); the peak's rest is the step's activations, logits (or the fused head's
        # chunk) and temporaries
        res["memory_between_steps_gib"] = allocated_gib()
        res["peak_host_rss_gib"] = host_peak_rss_gib()
        res["summary"] = summary(hf, lengths, res, gpus)
        results[mode] = res
        logger.info("%s: %s", mode, json.dumps(res["summary"]))
    if "reuse" in results and "recompute" in results:
        a = statistics.median(results["recompute"]["actor_phase_s"])
        b = statistics.median(results["reuse"]["actor_phase_s"])
        report["reuse_speedup_actor_phase"] = a / b
    if "reuse" in results and "plain" in results:
        u = statistics.median(results["reuse"]["step_s"])
        p = statistics.median(results["plain"]["step_s"])
        report["unirl_overhead_vs_plain"] = u / p - 1.0
    if backend.topology.rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        logger.info(
            "speedup %s overhead %s",
            report.get("reuse_speedup_actor_phase"),
            report.get("unirl_overhead_vs_plain"),
        )
    backend.close()


if __name__ == "__main__":
    main()
