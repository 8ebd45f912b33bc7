"""The GPU weight sync to a vLLM engine, without vLLM (it cannot be installed on the GPU machine):
time per GB of the CUDA IPC transport, and peak GPU memory of a weight stream at 7B shape.

    # 1. IPC time per GB, Qwen2.5-1.5B and -7B shapes (random bf16 weights, 1 GiB buckets)
    PYTHONPATH=$PWD python benchmarks/weight_transfer.py transfer \\
        --out benchmarks/results/weight_transfer/<date>_h200_<commit>_transfer.json
    # 1b. the verified sync's fingerprints on both sides of that sync
    PYTHONPATH=$PWD python benchmarks/weight_transfer.py verify \\
        --out benchmarks/results/weight_transfer/<date>_h200_<commit>_verify.json
    # 2. peak GPU memory of a sync at 7B shape, one GPU, against the trainer's own
    PYTHONPATH=$PWD python benchmarks/weight_transfer.py memory --backend megatron \\
        --out benchmarks/results/weight_transfer/<date>_h200_<commit>_memory-megatron.json
    PYTHONPATH=$PWD python benchmarks/weight_transfer.py memory --backend fsdp2 \\
        --out benchmarks/results/weight_transfer/<date>_h200_<commit>_memory-fsdp2.json

``transfer``: `IpcTransport` (unirl/rollouts/vllm/transport.py) sends every bucket to a receiver
process on the same GPU that does what vLLM's packed IPC consumer does (rebuild the buffer from
the handle, cut it up, clone each tensor on the GPU) and answers each ``update_weights``; the time
is the whole sync, start to finish, medians of ``--repeats``. Three cases:

- ``flat_on_cuda``: each bucket one flat GPU buffer in the packed layout, as
  ``stream_weights(device=cuda)`` makes them for the IPC / NCCL transports: the buffer itself is
  shared (no copy; the handle and the receiver's clone are the cost);
- ``buckets_on_cuda``: separate GPU tensors (not flat): one device copy into a new buffer more;
- ``buckets_on_cpu``: host tensors, as the stream yields them for the file transport: one
  host -> device copy per bucket more.

``memory``: builds the backend at Qwen2.5-7B's shape (bf16, one GPU; from a folder of random bf16
weights drawn on the GPU, `write_random_folder`, as the seeded fp32 CPU initialisation of 7B
parameters takes minutes), takes one RL step on a
small batch so that the optimizer's state exists (if that runs out of memory, the run is
repeated without the step and the JSON says so), then measures a sync as `IpcTransport` makes it:
the stream to a receiving rank 0 with its buckets on the GPU (``stream_weights(device=cuda)``),
each packed for IPC (`unirl.rollouts.serving.packing.pack_bucket`: a flat bucket is its own packed buffer). It reports the peak
GPU memory above the trainer's own (``torch.cuda.max_memory_allocated`` after a reset),
``sync_s`` and how many buckets went as they were (``buckets_sent_as_is`` of ``buckets``).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.megatron_throughput import MODELS  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402

logger = logging.getLogger("weight_transfer")
GIB = 1 << 30


# -- transfer ----------------------------------------------------------------------------------


def hf_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face parameter names and shapes of ``model`` (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(MODELS[model])
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(config)
    return [(n, tuple(p.shape)) for n, p in net.named_parameters()]


def random_buckets(
    shapes: list[tuple[str, tuple[int, ...]]], bucket_bytes: int, where: str
) -> list[list[tuple[str, torch.Tensor]]]:
    """Random bf16 buckets: ``where`` "flat" (one `FlatBucket` on the GPU per bucket, as the
    stream makes them for the GPU transports), "cuda" (separate GPU tensors) or "cpu"."""
    from unirl.core.weights.stream import FlatBucket, TensorSpec, bucketed

    g = torch.Generator(device="cuda").manual_seed(0)
    planned = bucketed(
        ((n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes), bucket_bytes
    )
    out = []
    for group in planned:
        if where == "flat":
            flat = FlatBucket([TensorSpec(n, tuple(t.shape), t.dtype) for n, t in group], "cuda")
            for slot in flat.slots:
                slot.normal_(generator=g)
            out.append(flat.tensors())
        else:
            out.append([
                (n, torch.randn(t.shape, generator=g, device="cuda", dtype=t.dtype).to(where))
                for n, t in group
            ])  # fmt: skip
    return out


def _receiver(inbox: Any, outbox: Any) -> None:
    """vLLM's packed IPC consumer, in short: map, cut, clone (then drop: a real engine copies
    the clones into its parameters)."""
    import base64
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from unirl.core.weights.fingerprint import Fingerprint

    torch.cuda.set_device(0)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    verify: Fingerprint | None = None
    while True:
        kind, info = inbox.get()
        if kind == "stop":
            return
        if kind == "verify":  # fingerprint the next syncs' tensors; report the last one's time
            seconds = None if verify is None else verify.seconds
            verify = Fingerprint() if info else None
            outbox.put(seconds)
            continue
        if kind == "update":
            args = list(pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))[uuid])
            args[6] = 0
            buffer = rebuild_cuda_tensor(*args)
            parts = buffer.split(info["tensor_sizes"])
            clones = [
                p.view(getattr(torch, d)).view(s).clone()
                for p, d, s in zip(parts, info["dtype_names"], info["shapes"])
            ]
            torch.cuda.synchronize()
            if verify is not None:  # the engine's side of the verified sync, on what it holds
                t0 = time.perf_counter()
                verify.add_named(zip(info["names"], clones))
                verify.keys  # noqa: B018 -- the GPU's pending sums, as the engine reads them
                verify.seconds += time.perf_counter() - t0
            del buffer, parts, clones
        outbox.put("ack")


class _Client:
    def __init__(self, inbox: Any, outbox: Any) -> None:
        self.inbox, self.outbox = inbox, outbox

    def _call(self, kind: str, info: Any = None) -> None:
        self.inbox.put((kind, info))
        assert self.outbox.get(timeout=120) == "ack"

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", init_info)

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info: dict) -> None:
        self._call("update", update_info)

    def finish_weight_update(self) -> None:
        self._call("finish")


def transfer(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from unirl.rollouts.vllm.transport import IpcTransport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(inbox, outbox), daemon=True)
    receiver.start()
    out: dict[str, Any] = {}
    try:
        transport = IpcTransport(_Client(inbox, outbox), device)
        for model in args.models:
            shapes = hf_shapes(model)
            row: dict[str, Any] = {}
            for where in ("flat", "cuda", "cpu"):
                buckets = random_buckets(shapes, args.bucket_mb << 20, where)
                gb = sum(t.numel() * t.element_size() for b in buckets for _, t in b) / 1e9
                times = []
                for _ in range(args.warmup + args.repeats):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    transport.send(iter(buckets))
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                median = statistics.median(times[args.warmup :])
                key = "flat_on_cuda" if where == "flat" else f"buckets_on_{where}"
                row[key] = {
                    "gb": gb,
                    "buckets": len(buckets),
                    "sync_s": times[args.warmup :],
                    "s_per_gb": median / gb,
                    "gb_per_s": gb / median,
                }
                logger.info("%s, %s: %.4f s/GB (%.1f GB)", model, key, median / gb, gb)
                del buckets
                torch.cuda.empty_cache()
            out[model] = row
        transport.close()
    finally:
        inbox.put(("stop", None))
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    return {
        "what": "one sync through IpcTransport to a receiver process on the same GPU that maps, "
        "cuts and clones every bucket (vLLM's packed IPC consumer); bf16 random weights",
        "bucket_mb": args.bucket_mb,
        "models": out,
    }


def verify(args: argparse.Namespace) -> dict[str, Any]:
    """The verified sync's cost at each model's shape: the IPC sync of flat GPU buckets (as
    ``transfer``'s ``flat_on_cuda``), then the same sync with the trainer fingerprinting the
    buckets as they pass (`fingerprinted`, as `WeightSync` does) and the receiver fingerprinting
    the tensors it cloned; each side's seconds against the plain sync's."""
    import torch.multiprocessing as mp

    from unirl.core.weights.fingerprint import Fingerprint, fingerprinted
    from unirl.rollouts.vllm.transport import IpcTransport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(inbox, outbox), daemon=True)
    receiver.start()
    out: dict[str, Any] = {}
    try:
        transport = IpcTransport(_Client(inbox, outbox), device)
        for model in args.models:
            buckets = random_buckets(hf_shapes(model), args.bucket_mb << 20, "flat")
            plain, trainer, engine, whole = [], [], [], []
            for _ in range(args.warmup + args.repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                transport.send(iter(buckets))
                torch.cuda.synchronize()
                plain.append(time.perf_counter() - t0)
                inbox.put(("verify", True))
                outbox.get(timeout=120)
                seen = Fingerprint(dtype=torch.bfloat16)
                t0 = time.perf_counter()
                transport.send(fingerprinted(iter(buckets), seen))
                torch.cuda.synchronize()
                whole.append(time.perf_counter() - t0)
                inbox.put(("verify", False))
                engine.append(outbox.get(timeout=120))
                trainer.append(seen.seconds)
            w = args.warmup
            sync = statistics.median(plain[w:])
            row = {
                "gb": sum(t.numel() * t.element_size() for b in buckets for _, t in b) / 1e9,
                "sync_s": statistics.median(plain[w:]),
                "trainer_fingerprint_s": statistics.median(trainer[w:]),
                "engine_fingerprint_s": statistics.median(engine[w:]),
                "sync_with_trainer_fingerprint_s": statistics.median(whole[w:]),
                "all": {"sync_s": plain, "trainer_s": trainer, "engine_s": engine},
            }
            row["trainer_over_sync"] = row["trainer_fingerprint_s"] / sync
            row["engine_over_sync"] = row["engine_fingerprint_s"] / sync
            logger.info("%s: %s", model, {k: v for k, v in row.items() if k != "all"})
            out[model] = row
            del buckets
            torch.cuda.empty_cache()
        transport.close()
    finally:
        inbox.put(("stop", None))
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    return {
        "what": "the verified sync's fingerprints (float64 count, sum, sum of squares, max |x| "
        "per layer) on each side of an IpcTransport sync of flat bf16 GPU buckets to a receiver "
        "process that maps, cuts and clones them; seconds per side against the plain sync",
        "bucket_mb": args.bucket_mb,
        "models": out,
    }


# -- memory ------------------------------------------------------------------------------------


def write_random_folder(
    model: str, folder: Path, shard_bytes: int = 4 * GIB, device: str = "cuda"
) -> Path:
    """A Hugging Face folder of ``model``'s shape with random bf16 weights (std 0.02), drawn on
    the GPU: loading it is much faster than the backends' seeded fp32 CPU initialisation of a 7B
    model (which alone takes longer than a device call allows)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    hf = dict(MODELS[model])
    AutoConfig.for_model(hf.pop("model_type"), **hf).save_pretrained(folder)
    g = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index, weight_map = 0, 0, {}

    def flush() -> None:
        nonlocal shard, size, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size, index = {}, 0, index + 1

    for name, shape in hf_shapes(model):
        t = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02
        if "norm" in name:
            t = torch.ones(shape, dtype=torch.bfloat16)
        shard[name] = t.cpu()
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return folder


def _backend_config(backend: str, run_dir: str, weights: str | None = None) -> dict[str, Any]:
    from benchmarks.backend_throughput import engine_config

    ns = argparse.Namespace(
        attention="packed", max_len=512, recompute_activations=True, fused_head=False,
        samples=8, group=4, tokens_per_microbatch=2048, tp=1, pp=1, vpp=None, cp=1,
        fsdp2_options=None, deepspeed_extra=None, liger_kernels=False,
    )  # fmt: skip
    data = engine_config(ns, dict(MODELS["qwen2.5-7b"]), backend, "reuse")
    data["logging"] = {"run_dir": run_dir, "tensorboard": False}
    data["progress"] = {"enabled": False}
    if weights is not None:  # the random folder in place of the seeded CPU initialisation
        data["model"] = {
            k: v for k, v in data["model"].items() if k not in ("hf_config", "init_seed")
        }
        data["model"]["path"] = weights
    return data


def memory_child(args: argparse.Namespace) -> dict[str, Any]:
    """In a fresh process: build, (step), sync once, report."""
    from benchmarks.megatron_throughput import rollout_records
    from unirl.backends import build_backend
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.step import RLStep
    from unirl.core.weights.stream import MIB, flat_buffer
    from unirl.rollouts.serving.packing import pack_bucket

    cfg = config_from_dict(_backend_config(args.backend, tempfile.mkdtemp(), args.weights))
    t0 = time.perf_counter()
    backend = build_backend(cfg, total_optimizer_steps=10, needs_reference=False)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "optimizer_step": args.step}
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        if args.step:
            vocab = MODELS["qwen2.5-7b"]["vocab_size"]
            batch = RolloutBatch.from_records(rollout_records([256] * 8, vocab, 4, 0))
            RLStep(cfg, backend).run(batch)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        own = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        sent = buckets = as_is = 0
        # what IpcTransport.send does with the stream it asks for (its bucket_device: the GPU)
        for bucket in backend.stream_weights(args.bucket_mb * MIB, dst=0, device=device):
            flat = flat_buffer(bucket)
            packed = pack_bucket(bucket, device)  # the bucket's own buffer when flat
            as_is += flat is not None and packed.buffer.data_ptr() == flat.data_ptr()
            sent += packed.buffer.numel()
            buckets += 1
            del packed, bucket, flat
        torch.cuda.synchronize()
        out.update(
            trainer_gib=own / GIB,
            sync_peak_above_trainer_gib=(torch.cuda.max_memory_allocated(device) - own) / GIB,
            bucket_gib=args.bucket_mb / 1024,
            model_gib=sent / GIB,
            buckets=buckets,
            buckets_sent_as_is=as_is,
            sync_s=time.perf_counter() - t0,
        )
    finally:
        backend.close()
    return out


def memory(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    # --weights DIR: keep the random folder there (made once, reused by the next backend's run)
    folder = Path(args.weights or tempfile.mkdtemp(prefix="unirl-7b-"))
    if not (folder / "model.safetensors.index.json").is_file():
        t0 = time.perf_counter()
        folder.mkdir(parents=True, exist_ok=True)
        write_random_folder("qwen2.5-7b", folder)
        torch.cuda.empty_cache()
        runs["random_folder_s"] = time.perf_counter() - t0
    start = time.perf_counter()
    for step in (True, False) if args.step else (False,):
        # the run with the step gets part of the budget, the fallback what is left
        left = args.timeout_s - (time.perf_counter() - start)
        timeout = min(left, 0.6 * args.timeout_s) if step else left
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "child.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "memory-child",
                   "--backend", args.backend, "--bucket-mb", str(args.bucket_mb),
                   "--weights", str(folder),
                   "--out", str(result)] + ([] if step else ["--no-step"])  # fmt: skip
            try:
                proc = subprocess.run(cmd, timeout=timeout, check=False,
                                      capture_output=True, text=True)  # fmt: skip
            except subprocess.TimeoutExpired:
                runs[f"step={step}"] = f"timed out after {timeout:.0f} s"
                logger.warning("memory run (step=%s) timed out", step)
                continue
            if proc.returncode == 0 and result.is_file():
                runs["with_optimizer_state" if step else "without_optimizer_state"] = json.loads(
                    result.read_text()
                )
                break
            tail = proc.stderr[-1500:]
            runs[f"step={step}"] = f"failed: {tail}"
            logger.warning("memory run (step=%s) failed: %s", step, tail)
    if args.weights is None:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "what": "peak GPU memory above the trainer's own and time of one weight sync as "
        "IpcTransport makes it (stream_weights to rank 0 with its buckets on the GPU, each "
        "packed for IPC: a flat bucket is sent as it is), Qwen2.5-7B shape, bf16, one GPU",
        "backend": args.backend,
        "runs": runs,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["transfer", "verify", "memory", "memory-child"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-1.5b", "qwen2.5-7b"])
    parser.add_argument("--bucket-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backend", choices=["megatron", "fsdp2"], default="megatron")
    parser.add_argument("--no-step", dest="step", action="store_false")
    parser.add_argument("--timeout-s", type=float, default=190, help="memory: both runs")
    parser.add_argument(
        "--weights",
        default=None,
        help="memory: where the random 7B HF folder is (made if absent, kept)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("weight_transfer.py measures CUDA IPC and GPU memory: it needs a GPU")
    if args.part == "memory-child":
        args.out.write_text(json.dumps(memory_child(args)))
        return
    parts = {"transfer": transfer, "verify": verify, "memory": memory}
    report = parts[args.part](args)
    report = {
        "command": "PYTHONPATH=$PWD python benchmarks/weight_transfer.py " + " ".join(sys.argv[1:]),
        "environment": run_environment(),
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("written %s", args.out)


if __name__ == "__main__":
    main()
