"""The verified weight sync's cost (``rollout.verify_sync``, unirl/core/weights/fingerprint.py) per
sync, against the sync's own time, on the CPU with the vLLM engine (file transport, fp32).

    PYTHONPATH=$PWD python benchmarks/verify_sync.py            # tiny example and ~100M model
    PYTHONPATH=$PWD python benchmarks/verify_sync.py --models tiny --repeats 3 --out x.json

For each model: one engine (examples/tiny_grpo_vllm.yaml, the ~100M model by --set overrides of
its model.hf_config), started by a first sync; then ``--repeats`` pairs of syncs of new weights
(every tensor moved), one with the check and one without, alternating, in buckets of
rollout.weight_bucket_mb (1 GiB). ``sync_s``: the whole `sync_weights` call; ``verify_s``: the
check's seconds inside it (the trainer's fingerprint of the buckets as they pass + the engine's
fingerprint through ``collective_rpc`` + the comparison). Medians; the ratio the target
(<= 5 %) refers to is ``verify_s / sync_s(verify off)``. The JSON records the exact command.
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

import attrs
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_files import head_commit, new_result_path  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402

logger = logging.getLogger("verify_sync")
EXAMPLE = ROOT / "examples" / "tiny_grpo_vllm.yaml"
# ~104M parameters: 12 layers of 768 (12 heads, 4 k/v heads), MLP 3072
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


def _measure(name: str, repeats: int, run_dir: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from unirl.core.config.run_config import load_config
    from unirl.core.weights.stream import MIB, bucketed
    from unirl.rollouts import build_rollout_source

    sets = [f"logging.run_dir={run_dir}", "progress.enabled=false", *MODELS[name]]
    cfg = load_config(EXAMPLE, sets)
    source = build_rollout_source(cfg)
    torch.manual_seed(0)
    weights = {
        k: v.detach().clone()
        for k, v in AutoModelForCausalLM.from_config(source.hf_config).float().state_dict().items()
    }
    params = sum(t.numel() for t in weights.values())
    bucket_bytes = cfg.rollout.weight_bucket_mb * MIB
    modes = {
        True: cfg,
        False: attrs.evolve(cfg, rollout=attrs.evolve(cfg.rollout, verify_sync=False)),
    }
    times: dict[bool, list[float]] = {True: [], False: []}
    verify: list[float] = []
    try:
        source.sync_weights(bucketed(weights.items(), bucket_bytes), policy_version=0)  # start
        for v in range(1, 2 * repeats + 1):
            check = v % 2 == 1
            source.cfg = modes[check]  # the source reads rollout.verify_sync at each sync
            moved = {k: t + 1e-3 * v for k, t in weights.items()}
            t0 = time.perf_counter()
            source.sync_weights(bucketed(moved.items(), bucket_bytes), policy_version=v)
            times[check].append(time.perf_counter() - t0)
            if check:
                verify.append(source.last_verify_s)
            del moved
    finally:
        source.close()
    on, off, ver = (statistics.median(x) for x in (times[True], times[False], verify))
    return {
        "model": name,
        "parameters": params,
        "overrides": MODELS[name],
        "repeats": repeats,
        "sync_s_verify_on": on,
        "sync_s_verify_off": off,
        "verify_s": ver,
        "verify_over_sync_off": ver / off,
        "all_sync_s_on": times[True],
        "all_sync_s_off": times[False],
        "all_verify_s": verify,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    out = args.out or new_result_path("verify_sync", "cpu")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            results.append(_measure(name, args.repeats, Path(tmp) / name))
            logger.info("%s", json.dumps(results[-1]))
    report = {
        "benchmark": "verify_sync",
        **run_environment(("transformers", "vllm")),  # the exact command, date, versions
        "commit": head_commit(),
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
