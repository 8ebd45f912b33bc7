"""Causal attention kernels on one GPU at Qwen3-4B's heads (32 query, 8 key/value, head dim 128,
bf16): forward and forward + backward of torch's flash varlen kernel (what unirl ran before),
SDPA on flash, on cuDNN (grouped heads native or repeated) and compiled FlexAttention, on one
sequence of 16k and 64k tokens and on four 4k sequences. Decides which kernel the packed
attention of every backend uses for long sequences (`unirl/backends/cudnn_attention.py`).

    PYTHONPATH=$PWD python benchmarks/attention_kernels.py            # writes a dated JSON

FLOPs: causal, ``4 * L^2 / 2 * Hq * D`` per sequence forward, backward counted as 2.5x the
forward (flash's count), so forward + backward is 3.5x.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.result_files import new_result_path  # noqa: E402
from benchmarks.run_environment import run_environment  # noqa: E402

HQ, HKV, D = 32, 8, 128
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _time(fn: Callable[[], object], iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _varlen(total: int, seqs: int) -> Kernel:
    from torch.nn.attention.varlen import varlen_attn

    n = total // seqs
    cu = torch.arange(0, total + 1, n, device="cuda", dtype=torch.int32)
    return lambda q, k, v: varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0))


def _sdpa(backend_name: str, repeat: bool) -> Callable[[int, int], Kernel]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def make(total: int, seqs: int) -> Kernel:
        n = total // seqs

        def fn(q, k, v):
            qq, kk, vv = (t.view(seqs, n, -1, D).transpose(1, 2) for t in (q, k, v))
            kw = {}
            if repeat:
                kk, vv = (t.repeat_interleave(HQ // HKV, dim=1) for t in (kk, vv))
            else:
                kw["enable_gqa"] = True
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, **kw)
            return out.transpose(1, 2).reshape(total, HQ, D)

        return fn

    return make


def _flex(total: int, seqs: int) -> Kernel:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.arange(total, device="cuda") // (total // seqs)
    mask = create_block_mask(
        lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, total, total,
        device="cuda",
    )  # fmt: skip
    compiled = torch.compile(flex_attention)

    def fn(q, k, v):
        qq, kk, vv = (t.transpose(0, 1)[None] for t in (q, k, v))
        return compiled(qq, kk, vv, block_mask=mask, enable_gqa=True)[0].transpose(0, 1)

    return fn


KERNELS = {
    "flash-varlen": _varlen,
    "sdpa-flash-gqa": _sdpa("FLASH_ATTENTION", repeat=False),
    "sdpa-cudnn-gqa": _sdpa("CUDNN_ATTENTION", repeat=False),
    "sdpa-cudnn-repeat": _sdpa("CUDNN_ATTENTION", repeat=True),
    "flex-compiled": _flex,
}


def measure(name: str, total: int, seqs: int, iters: int) -> dict[str, object]:
    n = total // seqs
    flops = seqs * 4 * n * n / 2 * HQ * D
    row: dict[str, object] = {"kernel": name, "tokens": total, "sequences": seqs}
    try:
        q = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(total, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2)
        )
        grad = torch.randn(total, HQ, D, device="cuda", dtype=torch.bfloat16)
        fn = KERNELS[name](total, seqs)
        with torch.no_grad():
            fwd = _time(lambda: fn(q, k, v), iters)
        both = _time(lambda: fn(q, k, v).backward(grad), iters)
        row |= {"fwd_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3,
                "fwd_tflops": flops / fwd / 1e12, "fwd_bwd_tflops": 3.5 * flops / both / 1e12}  # fmt: skip
    except Exception as exc:  # a kernel this torch / card does not have: recorded, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="16384x1,16384x4,65536x1", help="tokens x sequences")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels.py needs a CUDA GPU")
    rows = []
    for shape in args.shapes.split(","):
        total, seqs = (int(x) for x in shape.split("x"))
        for name in KERNELS:
            rows.append(measure(name, total, seqs, args.iters))
            print(json.dumps(rows[-1]), flush=True)
    card = torch.cuda.get_device_name()
    out = args.out or new_result_path("attention_kernels", "h200" if "H200" in card else "h100")
    result = {"environment": run_environment(()), "cudnn": torch.backends.cudnn.version(),
              "heads": {"q": HQ, "kv": HKV, "dim": D}, "rows": rows}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
