"""`unirl serve` on the CPU: what the Tinker API adds over the same work through the backend.

    PYTHONPATH=$PWD python benchmarks/serve_overhead.py                 # writes a dated JSON
    PYTHONPATH=$PWD python benchmarks/serve_overhead.py --steps 5 --repeats 1 --out /tmp/s.json
    PYTHONPATH=$PWD python benchmarks/serve_overhead.py --backend megatron   # fsdp2 by default

Two measurements on one process (the server in-process on a loopback port, one torch thread):

- **training step**: ``forward_backward`` (cross-entropy, ``--datums`` datums of ``--tokens``
  tokens) + ``optim_step`` through the official ``tinker`` SDK, against the same microbatches
  through the backend directly (``forward_backward`` + ``optimizer_step`` of a backend built
  the way the server builds one, same LoRA). Overhead = server / direct - 1: of the medians,
  the median over adjacent (server, direct) pairs (run alternately, so a change in machine load
  hits both of a pair alike) and of the fastest steps; ``--steps`` x ``--repeats`` pairs.
- **requests/s**: ``--small`` one-datum ``forward`` requests of 8 tokens submitted at once
  (futures), completed per second: the protocol's throughput when the model is negligible
  (the worker batches the queued ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_files import new_result_path  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402

MODEL = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}
RANK = 8


def _model(folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**MODEL)).save_pretrained(folder)
    return folder


def _batch(datums: int, tokens: int, seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, MODEL["vocab_size"], (datums, tokens + 1), generator=g).tolist()
    return [(s[:-1], s[1:]) for s in seqs]


def _sdk_steps(tc: Any, batch: list, steps: int) -> list[float]:
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
        times.append(time.perf_counter() - start)
    return times


def _direct_steps(backend: Any, batch: list, steps: int, tokens_per_mb: int) -> list[float]:
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
        times.append(time.perf_counter() - start)
    return times


def _requests_per_s(service: Any, tc: Any, n: int) -> float:
    from tinker import types

    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(1, 9))),
        loss_fn_inputs={"target_tokens": list(range(2, 10)), "weights": [1.0] * 8},
    )
    start = time.perf_counter()
    futures = [tc.forward([datum], "cross_entropy") for _ in range(n)]
    for f in futures:
        f.result()
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--datums", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--small", type=int, default=64)
    p.add_argument("--backend", default="fsdp2", choices=("fsdp2", "deepspeed", "megatron"))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    import tinker

    from tests.serve_fixtures import API_KEY, BASE, running_server
    from unirl.serve.sessions import build_training_backend

    lora = {
        "rank": RANK,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "lm_head",
        ],
        "init_seed": 0,
    }
    tmp = Path(tempfile.mkdtemp(prefix="serve_overhead_"))
    folder = _model(tmp / "model")
    batch = _batch(args.datums, args.tokens, 0)
    tokens_per_mb = 4096
    with running_server(
        folder,
        tmp / "state",
        tokens_per_microbatch=tokens_per_mb,
        train={"backend": args.backend, "model": {"max_seq_len": 1024}},
    ) as (url, rt):
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = service.create_lora_training_client(base_model=BASE, rank=RANK, seed=0).result()
        backend = build_training_backend(rt.cfg, folder, lora)
        _sdk_steps(tc, batch, 1), _direct_steps(backend, batch, 1, tokens_per_mb)  # warm-up
        server_s, direct_s = [], []
        for i in range(args.repeats * args.steps):  # alternating pairs, alternating order
            if i % 2:
                direct_s += _direct_steps(backend, batch, 1, tokens_per_mb)
                server_s += _sdk_steps(tc, batch, 1)
            else:
                server_s += _sdk_steps(tc, batch, 1)
                direct_s += _direct_steps(backend, batch, 1, tokens_per_mb)
        rps = _requests_per_s(service, tc, args.small)
        backend.close()
        service.close("success")
    server_med, direct_med = statistics.median(server_s), statistics.median(direct_s)
    result = {
        **run_environment(("transformers", "peft", "tinker", "fastapi", "uvicorn")),
        "backend": args.backend,
        "model": MODEL,
        "lora_rank": RANK,
        "step": {"datums": args.datums, "tokens_per_datum": args.tokens},
        "server_step_s": server_s,
        "direct_step_s": direct_s,
        "server_step_median_s": server_med,
        "direct_step_median_s": direct_med,
        "overhead": server_med / direct_med - 1.0,
        # per adjacent pair (a load change hits both of a pair alike), and on the fastest step
        "overhead_median_of_pairs": statistics.median(
            s / d - 1.0 for s, d in zip(server_s, direct_s)
        ),
        "overhead_fastest": min(server_s) / min(direct_s) - 1.0,
        "load_average_1min_at_end": os.getloadavg()[0],
        "small_forward_requests": args.small,
        "small_forward_requests_per_s": rps,
        "threads": torch.get_num_threads(),
    }
    variant = "" if args.backend == "fsdp2" else args.backend
    out = Path(args.out) if args.out else new_result_path("serve_overhead", "cpu", variant)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = (
        "server_step_median_s",
        "direct_step_median_s",
        "overhead",
        "overhead_median_of_pairs",
        "overhead_fastest",
        "small_forward_requests_per_s",
    )
    print(json.dumps({k: result[k] for k in keys}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
