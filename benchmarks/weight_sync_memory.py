"""Peak host memory of one weight sync, per rank, on the CPU (issue 28, item 1).

    PYTHONPATH=$PWD python benchmarks/weight_sync_memory.py [--backends deepspeed megatron]

A Llama of about 100M parameters (fp32) on 2 gloo ranks: DeepSpeed ZeRO-3 (dp2) and Megatron
tp2. Per rank it reads the trainer's own resident memory once the backend is built (VmRSS), then
measures the high-water mark (VmHWM, reset through /proc/self/clear_refs) of two syncs to a
rank-0 receiver that writes safetensors, as the vLLM file transport does:

- ``stream``: `TrainingBackend.stream_weights` with 64 MiB buckets, one file per bucket
  (`unirl.rollouts.vllm.weights.WeightFolder`); the other rank only takes part in the gathers;
- ``full_state_dict``: the old path, `hf_state_dict()` on every rank, a non-finite scan of it,
  one file from rank 0.

Results (MiB above the trainer's own, per rank) go to
``benchmarks/results/weight_sync_memory_cpu.json`` with the command. Large tensors are
``mmap``-backed in glibc, so what a sync frees goes back to the OS and the second measurement
starts from the trainer's own memory again (the baselines are recorded to show it); the stream
is measured once more after the full path (``stream_64mib_again``: no first-call allocations).
On the CPU the "device" is host memory too, so a ZeRO-3 stream's peak also holds the gathered
module (and DeepSpeed's gather buffer) of the largest parameter, the embedding here (94 MiB,
above the 64 MiB bucket, so it travels alone), and safetensors' serialised copy of a bucket.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULT = ROOT / "benchmarks/results/weight_sync_memory_cpu.json"
BUCKET_MB = 64
# ~106M parameters: embedding and head 2 x 24.6M, 8 layers x 7.1M
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
LAYOUTS = {
    "deepspeed": {"backend": "deepspeed", "deepspeed": {}, "parallel": {"zero_stage": 3}},
    "megatron": {"backend": "megatron", "megatron": {}, "parallel": {"tp": 2}},
}


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _config(name: str, run_dir: str) -> Any:
    from unirl.core.run.config import config_from_dict

    layout = LAYOUTS[name]
    data = {
        "backend": layout["backend"],
        layout["backend"]: layout[layout["backend"]],
        "model": {"hf_config": dict(HF_CONFIG), "max_seq_len": 64, "init_seed": 1},
        "batch": {
            "prompts_per_rollout": 2,
            "samples_per_prompt": 2,
            "samples_per_optimizer_step": 4,
            "micro_batch_size": 2,
        },
        "parallel": {**layout["parallel"], "world_size": 2},
        "logging": {"run_dir": run_dir, "tensorboard": False},
    }
    return config_from_dict(data, world_size=2)


def _measure(fn: Any) -> dict[str, float]:
    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    gc.collect()
    return {
        "baseline_mib": base / 2**20,
        "peak_above_baseline_mib": (peak - base) / 2**20,
        "seconds": seconds,
    }


def _worker(rank: int, world_size: int, name: str, work: str) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from unirl.core.backend_plugin import build_backend
    from unirl.core.weight_stream import MIB, as_buckets, drain, first_non_finite_local
    from unirl.rollouts.vllm.weights import WeightFolder

    torch.set_num_threads(1)
    hf = dict(HF_CONFIG)
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    backend = build_backend(_config(name, str(Path(work) / "run")), total_optimizer_steps=1)
    try:
        gc.collect()
        out: dict[str, Any] = {"trainer_rss_mib": _status("VmRSS") / 2**20}
        folder = WeightFolder.create(str(Path(work) / f"rank{rank}"), hf_config)

        def stream() -> None:
            buckets = backend.stream_weights(BUCKET_MB * MIB, dst=0)
            if rank == 0:
                folder.write(buckets)
            else:
                drain(buckets)

        def full() -> None:
            state = backend.hf_state_dict()  # every rank, as train.py did after every step
            assert first_non_finite_local(state.items()) is None
            if rank == 0:
                folder.write(as_buckets(state))
            del state

        out["stream_64mib"] = _measure(stream)
        out["full_state_dict"] = _measure(full)
        out["stream_64mib_again"] = _measure(stream)  # after the full path: no first-call costs
        out["model_mib"] = (
            sum(t.numel() * t.element_size() for t in backend.hf_state_dict().values()) / 2**20
        )
        folder.remove()
        return out
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    from tests.spawn import run_distributed

    results: dict[str, Any] = {
        "command": "PYTHONPATH=$PWD python benchmarks/weight_sync_memory.py "
        + shlex.join(sys.argv[1:]),
        "model": {**HF_CONFIG, "dtype": "fp32"},
        "bucket_mb": BUCKET_MB,
        "what": "MiB of host memory (VmHWM) above the rank's own (VmRSS before the sync)",
        "layouts": {},
    }
    for name in args.backends:
        with tempfile.TemporaryDirectory() as work:
            ranks = run_distributed(_worker, 2, name, work, timeout=900)
        results["layouts"][name] = {
            "layout": "ZeRO-3 dp2" if name == "deepspeed" else "tp2",
            "ranks": ranks,
        }
        for rank, r in enumerate(ranks):
            print(
                f"{name} rank {rank}: model {r['model_mib']:.0f} MiB, trainer "
                f"{r['trainer_rss_mib']:.0f} MiB; sync above it: stream "
                f"{r['stream_64mib']['peak_above_baseline_mib']:.0f} MiB, full state dict "
                f"{r['full_state_dict']['peak_above_baseline_mib']:.0f} MiB, stream again "
                f"{r['stream_64mib_again']['peak_above_baseline_mib']:.0f} MiB"
            )
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {RESULT}")


if __name__ == "__main__":
    main()
