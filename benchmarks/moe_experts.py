"""MoE experts without Transformer Engine: megatron-core's `SequentialMLP` (one matmul per expert)
against unirl's `GroupedExperts` (all experts in two ``torch._grouped_mm`` calls), forward +
backward, at the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, expert FFN 768) on
a packed batch of 16,384 tokens::

    PYTHONPATH=$PWD python benchmarks/moe_experts.py --device cuda \\
        --out benchmarks/results/moe_experts/<date>_h200_<commit>.json
    PYTHONPATH=$PWD python benchmarks/moe_experts.py --device cpu --out /tmp/moe_experts.json

(the second is a smoke run at a tiny shape). Two parts, each module built once per variant with
the same weights (`GroupedExperts` loads `SequentialMLP`'s state dict):

- **experts**: the experts module alone on the rows the dispatcher would hand it: every token
  routed to ``top_k`` experts drawn uniformly at random (seeded), rows sorted by expert, router
  probabilities in fp32. Also the cost of stacking the experts' weights, which `GroupedExperts`
  pays four times per forward + backward to keep `SequentialMLP`'s parameter layout.
- **layer** (CUDA only: megatron-core's router and all-to-all dispatcher have CUDA-only lines):
  one megatron-core `MoELayer` of the local (non-TE) spec, router + all-to-all token dispatcher
  (EP = 1) + experts, on hidden states ``[tokens, 1, hidden]``.

FLOPs count the matmuls of the active parameters (the dense benchmark's accounting): per token
``6 x 3 H F x top_k`` for the experts' forward + backward, plus ``6 H E`` for the router in the
layer. MFU = FLOPs / (time x 989 TFLOP/s), the H200's dense bf16 peak. Times are medians of
``--iters`` runs after ``--warmup``, synchronised around each; peak memory is the most allocated
during one forward + backward minus what was allocated before it (the inputs and weights),
weight gradients included (the same for both variants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.run_environment import run_environment

logger = logging.getLogger("moe_experts")

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16

SHAPES: dict[str, dict[str, int]] = {
    # Qwen/Qwen3-30B-A3B config.json: hidden_size, num_experts, num_experts_per_tok,
    # moe_intermediate_size
    "qwen3-30b-a3b": {"hidden": 2048, "experts": 128, "top_k": 8, "ffn": 768, "heads": 32},
    "tiny": {"hidden": 64, "experts": 8, "top_k": 2, "ffn": 32, "heads": 4},
}
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after ``warmup``."""
    times = []
    for i in range(warmup + iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _peak_gib(fn: Callable[[], None], device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def _config(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        ffn_hidden_size=shape["ffn"],
        moe_ffn_hidden_size=shape["ffn"],
        num_moe_experts=shape["experts"],
        moe_router_topk=shape["top_k"],
        moe_router_pre_softmax=False,  # softmax over the top-k logits: Qwen3's renormalised
        moe_router_load_balancing_type="none",  # the aux loss is unirl's (core router losses)
        moe_token_dispatcher_type="alltoall",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu",
    )


def _variants() -> dict[str, Any]:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from unirl.backends.megatron.moe.grouped_experts import ExpertsChoice, GroupedExperts

    return {
        "sequential": ExpertsChoice(module=SequentialMLP, name="sequential", reason="benchmark"),
        "grouped": ExpertsChoice(module=GroupedExperts, name="grouped", reason="benchmark"),
    }


def _summary(seconds: float, tokens: int, flops: float, device: torch.device) -> dict[str, Any]:
    return {
        "fwd_bwd_ms": seconds * 1e3,
        "tokens_per_s": tokens / seconds,
        "tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / (seconds * PEAK_BF16_FLOPS) if device.type == "cuda" else None,
    }


def bench_experts(args: argparse.Namespace, shape: dict[str, int], dtype, device) -> dict:
    """`SequentialMLP` and `GroupedExperts` alone on the same dispatched rows."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module

    from unirl.backends.megatron.moe.grouped_experts import experts_spec

    tokens, experts, top_k = args.tokens, shape["experts"], shape["top_k"]
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    tokens_per_expert = torch.bincount(chosen.reshape(-1), minlength=experts)
    rows = tokens * top_k
    x = torch.randn(rows, shape["hidden"], generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(rows, generator=g).to(device).requires_grad_()
    grad = torch.randn(rows, shape["hidden"], generator=g).to(device, dtype)
    flops = 6.0 * 3 * shape["hidden"] * shape["ffn"] * rows

    config = _config(shape, dtype, device)
    modules: dict[str, Any] = {}
    out: dict[str, Any] = {
        "tokens_per_expert_min_max": [int(tokens_per_expert.min()), int(tokens_per_expert.max())],
        "flops_fwd_bwd": flops,
    }
    outputs = {}
    for name, choice in _variants().items():
        torch.manual_seed(0)
        module = build_module(
            experts_spec(choice), experts, config, pg_collection=get_default_pg_collection()
        ).to(device)
        if "sequential" in modules:
            module.load_state_dict(modules["sequential"].state_dict())
        modules[name] = module

        def step(module: Any = module) -> None:
            module.zero_grad(set_to_none=True)
            x.grad = probs.grad = None
            y, _ = module(x, tokens_per_expert, probs)
            y.backward(grad)

        seconds = _time(step, device, args.warmup, args.iters)
        out[name] = {
            **_summary(seconds, tokens, flops, device),
            "peak_gib": _peak_gib(step, device),
        }
        with torch.no_grad():
            outputs[name] = module(x, tokens_per_expert, probs)[0].float()
        logger.info("experts %s: %.2f ms fwd+bwd", name, seconds * 1e3)
    out["max_abs_diff_grouped_vs_sequential"] = (
        (outputs["grouped"] - outputs["sequential"]).abs().max().item()
    )
    out["speedup_grouped_over_sequential"] = (
        out["sequential"]["fwd_bwd_ms"] / out["grouped"]["fwd_bwd_ms"]
    )
    fc1 = [e.linear_fc1.weight for e in modules["grouped"].local_experts]
    fc2 = [e.linear_fc2.weight for e in modules["grouped"].local_experts]

    def stacks() -> None:  # what GroupedExperts copies per forward + backward
        for _ in range(2):
            torch.stack(fc1)
            torch.stack(fc2)

    with torch.no_grad():
        out["grouped"]["weight_stacking_ms"] = _time(stacks, device, args.warmup, args.iters) * 1e3
    del modules
    return out


def bench_layer(args: argparse.Namespace, shape: dict[str, int], dtype, device) -> dict:
    """One megatron-core MoELayer (router, all-to-all dispatcher, experts) per variant; the
    grouped one is `GroupedMoELayer` (its dispatcher without host syncs), as in the model."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from unirl.backends.megatron.moe.grouped_dispatch import GroupedMoELayer
    from unirl.backends.megatron.moe.grouped_experts import GroupedExperts, experts_spec

    if device.type != "cuda":
        return {"skipped": "megatron-core's router and all-to-all dispatcher need CUDA"}
    tokens = args.tokens
    config = _config(shape, dtype, device)
    mlp_spec = get_gpt_layer_local_spec(
        num_experts=shape["experts"], moe_grouped_gemm=False
    ).submodules.mlp
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, 1, shape["hidden"], generator=g).to(device, dtype)
    hidden.requires_grad_()
    grad = torch.randn(tokens, 1, shape["hidden"], generator=g).to(device, dtype)
    flops = 6.0 * tokens * shape["hidden"] * (3 * shape["ffn"] * shape["top_k"] + shape["experts"])
    out: dict[str, Any] = {"flops_fwd_bwd": flops}
    reference = None
    outputs = {}
    for name, choice in _variants().items():
        spec = dataclasses.replace(
            mlp_spec,
            # as the model's spec (`moe_block_spec`): grouped experts in a GroupedMoELayer
            module=GroupedMoELayer if choice.module is GroupedExperts else mlp_spec.module,
            submodules=dataclasses.replace(mlp_spec.submodules, experts=experts_spec(choice)),
        )
        torch.manual_seed(0)
        layer = build_module(spec, config=config).to(device)
        if reference is None:
            # megatron modules put None extra states in their state dicts
            reference = {
                k: v.clone() if isinstance(v, torch.Tensor) else v
                for k, v in layer.state_dict().items()
            }
        else:
            layer.load_state_dict(reference)

        def step(layer: Any = layer) -> None:
            layer.zero_grad(set_to_none=True)
            hidden.grad = None
            y, _ = layer(hidden)
            y.backward(grad)

        seconds = _time(step, device, args.warmup, args.iters)
        out[name] = {
            **_summary(seconds, tokens, flops, device),
            "peak_gib": _peak_gib(step, device),
        }
        with torch.no_grad():
            outputs[name] = layer(hidden)[0].float()
        logger.info("layer %s: %.2f ms fwd+bwd", name, seconds * 1e3)
        del layer
        torch.cuda.empty_cache()
    out["max_abs_diff_grouped_vs_sequential"] = (
        (outputs["grouped"] - outputs["sequential"]).abs().max().item()
    )
    out["speedup_grouped_over_sequential"] = (
        out["sequential"]["fwd_bwd_ms"] / out["grouped"]["fwd_bwd_ms"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="cpu: tiny")
    parser.add_argument("--tokens", type=int, default=None, help="cuda 16384, cpu 256")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="cuda bf16, cpu fp32"
    )
    parser.add_argument("--parts", default="experts,layer")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.shape = args.shape or ("qwen3-30b-a3b" if cuda else "tiny")
    args.tokens = args.tokens or (16384 if cuda else 256)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from unirl.backends.megatron.compat import te as te_compat
    from unirl.backends.megatron.moe.grouped_experts import select_experts

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )
    ps.initialize_model_parallel(1, 1)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    te_compat.install()  # the router's gating without TE
    shape, dtype = SHAPES[args.shape], _DTYPES[args.dtype]
    choice = select_experts(device, _config(shape, dtype, device))
    report: dict[str, Any] = {
        "environment": run_environment(),
        "shape": {"name": args.shape, **shape},
        "tokens": args.tokens,
        "dtype": args.dtype,
        "selector": {"choice": choice.name, "reason": choice.reason},
        "peak_flops": PEAK_BF16_FLOPS if cuda else None,
        "results": {},
    }
    parts = {"experts": bench_experts, "layer": bench_layer}
    for part in args.parts.split(","):
        report["results"][part] = parts[part](args, shape, dtype, device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each part
    logger.info("wrote %s", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
