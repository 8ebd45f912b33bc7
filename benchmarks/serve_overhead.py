"""`unirl serve`: what the Tinker API adds over the same work through the backend.

    PYTHONPATH=$PWD python benchmarks/serve_overhead.py                 # writes a dated JSON
    PYTHONPATH=$PWD python benchmarks/serve_overhead.py --steps 5 --repeats 1 --out /tmp/s.json
    PYTHONPATH=$PWD python benchmarks/serve_overhead.py --backend megatron   # fsdp2 by default

Two measurements on one process (the server in-process on a loopback port):

- **training step**: ``forward_backward`` (cross-entropy, ``--datums`` datums of ``--tokens``
  tokens) + ``optim_step`` through the official ``tinker`` SDK, against the same microbatches
  through the backend directly (``forward_backward`` + ``optimizer_step``, what `unirl train`
  calls: of a backend built the way the server builds one, same LoRA, or the server's own
  backend, ``--direct``). Overhead = server / direct - 1: of the medians, the median over
  adjacent (server, direct) pairs (run alternately, so a change in machine load hits both of a
  pair alike) and of the fastest steps; ``--steps`` x ``--repeats`` pairs after one warm-up step
  of each.
- **requests/s**: ``--small`` one-datum ``forward`` requests of 8 tokens submitted at once
  (futures), completed per second: the protocol's throughput when the model is negligible
  (the worker batches the queued ones).

``--shape tiny`` (the default: a 4-layer, 256-wide Llama, LoRA rank 8 on every linear and the LM
head, 8 datums of 256 tokens, one torch thread). ``--shape qwen3-4b`` is issue 47's one-GPU row:
Qwen3-4B's shape (`benchmarks/megatron_throughput.py`'s, random weights saved as a bf16 Hugging
Face folder), LoRA rank 16 (alpha 32) on every decoder linear (the tied LM head untrained, as the
LoRA rows of `benchmarks/long_sequences.sh`), one datum of 16,384 tokens per step, the fused head
and activation recompute (Megatron: the first 12 layers) as those rows; the direct path runs on
the server's own backend (one 4B model on the GPU, one build)::

    PYTHONPATH=$PWD python benchmarks/serve_overhead.py --shape qwen3-4b --device cuda \\
        --backend megatron --steps 6 --repeats 1 --small 32

and its dry run on the CPU (a shrunken shape, fp32)::

    PYTHONPATH=$PWD python benchmarks/serve_overhead.py --shape qwen3-4b --device cpu \\
        --layers 1 --hidden 256 --vocab 1024 --tokens 256 --steps 1 --repeats 1 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.megatron_throughput import cudnn_attention_state  # noqa: E402
from benchmarks.result_files import new_result_path  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402
from benchmarks.serve_shapes import (  # noqa: E402
    SHAPES,
    model_config,
    save_model,
    train_section,
)

logger = logging.getLogger("serve_overhead")


def _batch(datums: int, tokens: int, vocab: int, seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, vocab, (datums, tokens + 1), generator=g).tolist()
    return [(s[:-1], s[1:]) for s in seqs]


def _sync(device: str) -> None:
    """Wait for the GPU: a step's time is its kernels' (the server's worker thread launched
    them; a device-wide sync waits for every stream)."""
    if device == "cuda":
        torch.cuda.synchronize()


def _sdk_steps(tc: Any, batch: list, steps: int, device: str) -> list[float]:
    from tinker import types

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(x),
            loss_fn_inputs={"target_tokens": y, "weights": [1.0] * len(y)},
        )
        for x, y in batch
    ]
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _direct_steps(
    backend: Any, batch: list, steps: int, tokens_per_mb: int, device: str
) -> list[float]:
    from unirl.core.backend import AdamStepSettings
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress
    from unirl.serve.batching import TokenDatum, pack
    from unirl.serve.losses import SummedLoss, sdk_loss

    settings = AdamStepSettings(
        lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip=0.0
    )
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        datums = [
            TokenDatum(tokens=torch.tensor(x), targets=torch.tensor(y), mask=torch.ones(len(y)))
            for x, y in batch
        ]
        mbs = pack(datums, tokens_per_mb)
        loss_fn = SummedLoss(settings=sdk_loss("cross_entropy").settings({}))
        with MicrobatchProgress("direct", len(mbs), backend.topology, enabled=False) as bar:
            spec = LogprobSpec(vocab_size=backend.vocab_size)  # as the server (megatron pads)
            backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
        backend.set_step_settings(settings)
        backend.optimizer_step()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _requests_per_s(service: Any, tc: Any, n: int) -> float | None:
    from tinker import types

    if n == 0:
        return None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, 9))),
        loss_fn_inputs={"target_tokens": list(range(2, 10)), "weights": [1.0] * 8},
    )
    start = time.perf_counter()
    futures = [tc.forward([datum], "cross_entropy") for _ in range(n)]
    for f in futures:
        f.result()
    return n / (time.perf_counter() - start)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="bf16 on cuda")
    p.add_argument("--layers", type=int, default=None, help="override (smoke runs)")
    p.add_argument("--hidden", type=int, default=None, help="override (smoke runs)")
    p.add_argument("--vocab", type=int, default=None, help="override (smoke runs)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--datums", type=int, default=None, help="the shape's by default")
    p.add_argument("--tokens", type=int, default=None, help="per datum; the shape's by default")
    p.add_argument("--small", type=int, default=64, help="small forward requests; 0: none")
    p.add_argument("--backend", default="fsdp2", choices=("fsdp2", "deepspeed", "megatron"))
    p.add_argument(
        "--direct",
        default=None,
        choices=("own", "server"),
        help="the direct path's backend: one of its own (tiny's default) or the server "
        "client's (the GPU shapes': one model on the GPU, one build)",
    )
    p.add_argument("--model-dir", default=None, help="the HF folder, kept for the next run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = SHAPES[args.shape]
    args.datums = args.datums or shape.datums
    args.tokens = args.tokens or shape.tokens
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.direct = args.direct or ("own" if args.shape == "tiny" else "server")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this machine has no CUDA device; --device cpu for a dry run")
    return args


def _pairs(args: argparse.Namespace, tc: Any, backend: Any, batch: list, mb_tokens: int) -> dict:
    """One warm-up step of each, then ``steps x repeats`` alternating (server, direct) pairs."""
    dev = args.device
    _sdk_steps(tc, batch, 1, dev), _direct_steps(backend, batch, 1, mb_tokens, dev)  # warm-up
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    server_s: list[float] = []
    direct_s: list[float] = []
    for i in range(args.repeats * args.steps):  # alternating pairs, alternating order
        if i % 2:
            direct_s += _direct_steps(backend, batch, 1, mb_tokens, dev)
            server_s += _sdk_steps(tc, batch, 1, dev)
        else:
            server_s += _sdk_steps(tc, batch, 1, dev)
            direct_s += _direct_steps(backend, batch, 1, mb_tokens, dev)
    cuda = dev == "cuda"  # the steps' peak (the server's backend and, --direct own, the other)
    memory = {
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "memory_between_steps_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
    }
    return {"server_step_s": server_s, "direct_step_s": direct_s, **memory}


def _measure(args: argparse.Namespace, folder: Path, hf: dict, tmp: Path) -> dict[str, Any]:
    """The server on ``folder``, one SDK training client, the direct path's backend; the
    pairs and the small requests."""
    import tinker

    from tests.serve_fixtures import API_KEY, BASE, running_server
    from unirl.serve.sessions import build_training_backend, lora_section

    shape = SHAPES[args.shape]
    batch = _batch(args.datums, args.tokens, hf["vocab_size"], 0)
    mb_tokens = max(4096, args.tokens)  # one datum per microbatch at the longest
    lora_config = {"rank": shape.lora_rank, "seed": 0, "train_unembed": shape.train_unembed}
    train = train_section(args, hf)
    with running_server(folder, tmp / "state", tokens_per_microbatch=mb_tokens, train=train) as (
        url,
        rt,
    ):
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        t0 = time.perf_counter()
        tc = service.create_lora_training_client(base_model=BASE, **lora_config).result()
        build_s = time.perf_counter() - t0
        session = rt.sessions.get(tc.model_id)  # the client's model.lora, as the server built it
        if args.direct == "own":
            lora = lora_section(rt.cfg, {"lora_config": lora_config})
            assert lora == session.lora
            backend = build_training_backend(rt.cfg, folder, lora)
        else:
            backend = session.backend
        memory_after_build = (
            torch.cuda.memory_allocated() / 2**30 if args.device == "cuda" else None
        )
        times = _pairs(args, tc, backend, batch, mb_tokens)
        rps = _requests_per_s(service, tc, args.small)
        if args.direct == "own":
            backend.close()
        service.close("success")
    return {
        **times,
        "server_build_s": build_s,
        "memory_after_build_gib": memory_after_build,
        "small_forward_requests_per_s": rps,
        "train": train,
        "lora": dict(session.lora),
        "tokens_per_microbatch": mb_tokens,
    }


def _result(args: argparse.Namespace, hf: dict, measured: dict[str, Any]) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    server_s, direct_s = measured["server_step_s"], measured["direct_step_s"]
    server_med, direct_med = statistics.median(server_s), statistics.median(direct_s)
    step_tokens = args.datums * args.tokens
    cuda = args.device == "cuda"
    return {
        **run_environment(
            ("transformers", "peft", "tinker", "fastapi", "uvicorn", "megatron-core")
        ),
        "backend": args.backend,
        "shape": args.shape,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": args.dtype,
        "cudnn_attention": cudnn_attention_state(),
        "direct": args.direct,
        "model": hf,
        "lora_rank": shape.lora_rank,
        "step": {"datums": args.datums, "tokens_per_datum": args.tokens},
        **measured,
        "server_step_median_s": server_med,
        "direct_step_median_s": direct_med,
        "server_tokens_per_s": step_tokens / server_med,
        "direct_tokens_per_s": step_tokens / direct_med,
        "overhead": server_med / direct_med - 1.0,
        # per adjacent pair (a load change hits both of a pair alike), and on the fastest step
        "overhead_median_of_pairs": statistics.median(
            s / d - 1.0 for s, d in zip(server_s, direct_s)
        ),
        "overhead_fastest": min(server_s) / min(direct_s) - 1.0,
        "load_average_1min_at_end": os.getloadavg()[0],
        "small_forward_requests": args.small,
        "threads": torch.get_num_threads(),
    }


def _out_path(args: argparse.Namespace, result: dict[str, Any]) -> Path:
    if args.out:
        return Path(args.out)
    if args.shape == "tiny" and args.device == "cpu":  # the CPU row's names, as before
        return new_result_path(
            "serve_overhead", "cpu", "" if args.backend == "fsdp2" else args.backend
        )
    name = result["device_name"].lower()
    hardware = "h200" if "h200" in name else "h100" if "h100" in name else "cpu"
    return new_result_path("serve_overhead", hardware, f"{args.shape}-{args.backend}")


def main() -> None:
    args = _parse()
    if args.device == "cpu":
        torch.set_num_threads(1)
    hf = model_config(args)
    tmp = Path(tempfile.mkdtemp(prefix="serve_overhead_"))
    try:
        folder = Path(args.model_dir) if args.model_dir else tmp / "model"
        t0 = time.perf_counter()
        save_model(hf, folder, args.dtype, args.device)
        model_s = time.perf_counter() - t0
        result = _result(args, hf, _measure(args, folder, hf, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the 4B folder is 8 GB
    result["model_folder_s"] = model_s
    out = _out_path(args, result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = (
        "device_name",
        "server_step_median_s",
        "direct_step_median_s",
        "server_tokens_per_s",
        "direct_tokens_per_s",
        "overhead",
        "overhead_median_of_pairs",
        "overhead_fastest",
        "peak_memory_gib",
        "small_forward_requests_per_s",
    )
    logger.info("%s", json.dumps({k: result.get(k) for k in keys}))
    logger.info("wrote %s", out)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
