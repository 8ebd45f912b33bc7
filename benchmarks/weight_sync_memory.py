"""Peak host memory of one weight sync, per rank, on the CPU (issue 28, item 1).

    PYTHONPATH=$PWD python benchmarks/weight_sync_memory.py [--backends deepspeed megatron fsdp2]

A Llama of about 100M parameters (fp32, 404 MiB) on 2 gloo ranks: DeepSpeed ZeRO-3 (dp2),
Megatron tp2 and FSDP2 (full sharding, dp2). Per rank:

1. the backend is built and trains one RL step (a warm-up: the optimizer's state, the gradient
   buffers and the allocator's first-use pages exist before anything is measured, so they are
   not blamed on the sync);
2. **the trainer's own** memory is then the rank's resident memory (VmRSS) at rest; a second
   RL step is measured against it too (``train_step``: how far above its resting memory the
   trainer itself goes while it trains);
3. each sync is measured against the resident memory just before it: the high-water mark of
   the resident set (VmHWM, reset through /proc/self/clear_refs) minus VmRSS before, and the
   peak of glibc's live allocated bytes (``mallinfo2``, sampled every millisecond in a thread:
   what the sync holds, with the allocator's free-but-kept pages left out). The syncs go to a
   rank-0 receiver that writes safetensors, as the vLLM file transport does:

   - ``stream``: `TrainingBackend.stream_weights` with 64 MiB buckets, one file per bucket
     (`unirl.rollouts.serving.weights.WeightFolder`); the other rank only takes part in the
     gathers; measured three times (the first sync of a process, then two more);
   - ``full_state_dict``: the old path, `hf_state_dict()` on every rank, a non-finite scan of
     it, one file from rank 0 (for comparison; measured after the streams).

The limit the stream is held to is one bucket: ``max(bucket, largest tensor)`` (a tensor larger
than a bucket travels alone; here the 94 MiB embedding and head). Results (MiB) go to
a new dated file under ``benchmarks/results/weight_sync_memory/`` with the command and the machine's load.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_files import new_result_path  # noqa: E402 (after the path insert)

BUCKET_MB = 64
STREAMS = 3
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
    "deepspeed": ("ZeRO-3 dp2", {"backend": "deepspeed", "parallel": {"zero_stage": 3}}),
    "megatron": ("tp2", {"backend": "megatron", "parallel": {"tp": 2}}),
    "fsdp2": ("full sharding dp2", {"backend": "fsdp2", "parallel": {}}),
}
# one RL step's rollouts: 2 prompts x 2 samples
RECORDS = [
    {
        "prompt_tokens": [1 + i, 2, 3, 4],
        "response_tokens": [5, 6 + i, 7],
        "reward": float(i % 2),
        "group_id": i // 2,
    }
    for i in range(4)
]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def _live_bytes() -> int:
    """glibc's bytes in use: every arena's allocated chunks plus the mmapped ones."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _status(key: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class _LivePeak:
    """The highest `_live_bytes` seen, sampled every millisecond in a thread."""

    def __enter__(self) -> _LivePeak:
        self.peak = _live_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _live_bytes())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _live_bytes())


def _measure(fn: Callable[[], None]) -> dict[str, float]:
    gc.collect()
    base, live = _status("VmRSS"), _live_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    with _LivePeak() as sampler:
        fn()
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    gc.collect()
    return {
        "rss_before_mib": base / 2**20,
        "rss_peak_above_mib": (peak - base) / 2**20,
        "live_peak_above_mib": (sampler.peak - live) / 2**20,
        "rss_after_mib": _status("VmRSS") / 2**20,
        "seconds": seconds,
    }


def _config(name: str, run_dir: str) -> Any:
    from unirl.core.config.run_config import config_from_dict

    layout = LAYOUTS[name][1]
    data = {
        "backend": layout["backend"],
        "model": {"hf_config": dict(HF_CONFIG), "max_seq_len": 64, "init_seed": 1},
        "batch": {
            "prompts_per_rollout": 2,
            "samples_per_prompt": 2,
            "samples_per_optimizer_step": 4,
            "micro_batch_size": 2,
        },
        "algorithm": {"advantage_estimator": "grpo"},
        "parallel": {**layout["parallel"], "world_size": 2},
        "logging": {"run_dir": run_dir, "tensorboard": False},
    }
    return config_from_dict(data, world_size=2)


def _worker(rank: int, world_size: int, name: str, work: str) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.protocols.backend_plugin import build_backend
    from unirl.core.step import RLStep
    from unirl.core.weights.stream import MIB, as_buckets, drain, first_non_finite_local
    from unirl.rollouts.serving.weights import WeightFolder

    torch.set_num_threads(1)
    hf = dict(HF_CONFIG)
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    cfg = _config(name, str(Path(work) / "run"))
    backend = build_backend(cfg, total_optimizer_steps=3)
    try:
        step = RLStep(cfg, backend)
        batch = RolloutBatch.from_records(RECORDS)
        step.run(batch, rl_step=0)  # the warm-up step
        out: dict[str, Any] = {"train_step": _measure(lambda: step.run(batch, rl_step=1))}
        gc.collect()
        out["trainer_rss_mib"] = _status("VmRSS") / 2**20
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

        out["streams"] = [_measure(stream) for _ in range(STREAMS)]
        out["full_state_dict"] = _measure(full)
        state = backend.hf_state_dict()
        out["model_mib"] = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        out["largest_tensor_mib"] = (
            max(t.numel() * t.element_size() for t in state.values()) / 2**20
        )
        del state
        folder.remove()
        return out
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    # Named before the run, so that a checkout without git fails before the work, not after.
    out = new_result_path("weight_sync_memory", "cpu")
    from tests.spawn import run_distributed

    results: dict[str, Any] = {
        "command": "PYTHONPATH=$PWD python benchmarks/weight_sync_memory.py "
        + shlex.join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, shared; load average before the run "
        + " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "model": {**HF_CONFIG, "dtype": "fp32"},
        "bucket_mb": BUCKET_MB,
        "trainer_own": "VmRSS at rest after one warm-up RL step (optimizer state allocated)",
        "what": "per sync, MiB above VmRSS just before it: rss_peak_above_mib = VmHWM - VmRSS; "
        "live_peak_above_mib = the peak of glibc's allocated bytes (mallinfo2, sampled 1 ms) "
        "minus those before; limit_mib = max(bucket, largest tensor)",
        "layouts": {},
    }
    for name in args.backends:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as work:
            ranks = run_distributed(_worker, 2, name, work, timeout=1200)
        limit = max(BUCKET_MB, ranks[0]["largest_tensor_mib"])
        results["layouts"][name] = {
            "layout": LAYOUTS[name][0],
            "limit_mib": limit,
            "seconds": time.perf_counter() - t0,
            "ranks": ranks,
        }
        for rank, r in enumerate(ranks):
            print(
                f"{name} rank {rank}: model {r['model_mib']:.0f} MiB, trainer "
                f"{r['trainer_rss_mib']:.0f} MiB (a step goes "
                f"{r['train_step']['rss_peak_above_mib']:.0f} above); limit {limit:.0f}; "
                "streams RSS/live above: "
                + ", ".join(
                    f"{s['rss_peak_above_mib']:.0f}/{s['live_peak_above_mib']:.0f}"
                    for s in r["streams"]
                )
                + f"; full state dict {r['full_state_dict']['rss_peak_above_mib']:.0f}/"
                f"{r['full_state_dict']['live_peak_above_mib']:.0f}"
            )
    results["load_average_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
