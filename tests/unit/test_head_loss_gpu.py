"""The kernels' path of head_loss (cuBLAS matmuls in the inputs' dtype, the Triton kernels of
`unirl.core.maths.kernels.logprobs_triton` for the statistics and the in-place logits gradient)
against fp64 plain PyTorch (`tests.unit.test_head_loss`) and against the logits path (head matmul
+ `logprobs_from_logits` + the same core loss + autograd): on a CUDA GPU, and on the CPU through
Triton's interpreter (``TRITON_INTERPRET=1``, in a child process) where triton is installed.

    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/unit/test_head_loss_gpu.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.test_head_loss import CASES, core_loss, make, reference, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
TEMPERATURE = 0.7
# (tokens, hidden, vocab rows, true vocabulary, token chunk): several chunks with a ragged last
# one, padding rows, one chunk; on CUDA also a head-sized vocabulary with the default chunk
SMALL = ((13, 16, 37, 37, 5), (13, 16, 37, 29, 4), (13, 16, 1000, 997, None))
LARGE = ((3000, 256, 32000, 31990, 512), (3000, 256, 32000, 32000, None))


def logits_path(p, settings, h, w, n_ids, entropy_grad):
    """The head's matmul in the inputs' dtype, then `logprobs_from_logits` and the core loss."""
    from unirl.core.maths.logprobs import logprobs_from_logits

    logits = h @ w.T
    logp, ent = logprobs_from_logits(
        logits, p["targets"], temperature=TEMPERATURE, vocab_size=n_ids, with_entropy=True,
        entropy_grad=entropy_grad,
    )  # fmt: skip
    loss, _ = core_loss(p, settings)(logp, ent)
    return loss, logp, ent


# fp64 references by (shape, dtype, case): the problems are seeded, so the variants' tests in the
# same process reuse the first test's (the large ones cost seconds of CPU each)
_REFERENCES: dict[tuple, dict[str, torch.Tensor]] = {}


def check_kernel_path(device: str, shapes, **options) -> list[str]:
    """Every case in fp32 and bf16; returns the failures. ``options``: head_loss's variants
    (``overlap``, ``dweight_fp32``)."""
    from unirl.core.maths import head_loss as hl
    from unirl.core.maths.kernels import logprobs_triton

    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for n_tokens, hidden_size, vocab, n_ids, chunk in shapes:
            for case, (terms, settings) in sorted(CASES.items()):
                entropy_grad = settings.entropy_coef != 0
                p = make(n_tokens, hidden_size, vocab, dtype, 3, n_ids)
                key = (n_tokens, hidden_size, vocab, n_ids, dtype, case)
                if key not in _REFERENCES:
                    _REFERENCES[key] = reference(
                        p, terms, temperature=TEMPERATURE, vocab_size=n_ids
                    )
                ref = _REFERENCES[key]
                p = {k: v.to(device) for k, v in p.items()}
                h = p["hidden"].clone().requires_grad_(True)
                w = p["weight"].clone().requires_grad_(True)
                loss = core_loss(p, settings)
                if device == "cuda":
                    out = hl.head_loss(
                        h, w, p["targets"], loss, temperature=TEMPERATURE, vocab_size=n_ids,
                        with_entropy=True, entropy_grad=entropy_grad, chunk_size=chunk,
                        kernel="triton", **options,
                    )  # fmt: skip
                else:  # the public entry refuses CPU tensors for the kernels: the inner call
                    out = hl._head_loss(
                        h, w, p["targets"], loss, group=None, inv_temp=1 / TEMPERATURE,
                        vocab_start=0, n_valid=n_ids, chunk=chunk or 64, with_entropy=True,
                        entropy_grad=entropy_grad, kernels=logprobs_triton, **options,
                    )  # fmt: skip
                out.loss.backward()
                h2 = p["hidden"].clone().requires_grad_(True)
                w2 = p["weight"].clone().requires_grad_(True)
                loss2, logp2, ent2 = logits_path(p, settings, h2, w2, n_ids, entropy_grad)
                loss2.backward()
                # bf16: both paths round the logits to bf16 (against fp64: that rounding); the
                # weight's gradient here is summed over token chunks in bf16
                fp32 = dtype == torch.float32
                vs_ref = 2e-5 if fp32 else 3e-2
                vs_logits = 2e-5 if fp32 else 3e-3
                grad_tol = 1e-4 if fp32 else 2e-2
                # Against fp64 the gradients cannot beat the logits path's own: both round the
                # logits and their gradient to bf16, and with the entropy's gradient, p (E[z] - z)
                # amplifies the logits' rounding (|z| ~ 10 here: ~0.02 per logit). So the bound is
                # the larger of grad_tol and 1.25x the logits path's error (the extra 25%: the
                # weight's gradient rounded once per token chunk, ~sqrt(chunks) 2**-9 relative).
                dh_floor = 1.25 * rel_err(h2.grad.cpu(), ref["dh"])
                dw_floor = 1.25 * rel_err(w2.grad[:n_ids].cpu(), ref["dw"][:n_ids])
                name = f"{dtype} {case} {n_tokens}x{hidden_size}x{vocab}/{n_ids}/{chunk}"
                loss_err = rel_err(out.loss.detach(), loss2.detach().double())
                errs = {
                    "loss vs logits": (loss_err, vs_logits),
                    "logp vs fp64": (rel_err(out.logprobs.cpu(), ref["logp"]), vs_ref),
                    "logp vs logits": (rel_err(out.logprobs, logp2.detach().double()), vs_logits),
                    "entropy vs logits": (rel_err(out.entropy, ent2.detach().double()), vs_logits),
                    "dh vs fp64": (rel_err(h.grad.cpu(), ref["dh"]), max(grad_tol, dh_floor)),
                    "dw vs fp64": (
                        rel_err(w.grad[:n_ids].cpu(), ref["dw"][:n_ids]),
                        max(grad_tol, dw_floor),
                    ),
                    "dh vs logits": (rel_err(h.grad, h2.grad.double()), grad_tol),
                    "dw vs logits": (rel_err(w.grad, w2.grad.double()), grad_tol),
                }
                for key, (err, tol) in errs.items():
                    if not err < tol:
                        failures.append(f"{name} {key}: {err:.2e} (tolerance {tol:.0e})")
                if not torch.all(w.grad[n_ids:] == 0):
                    failures.append(f"{name}: padding rows' gradient")
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_kernel_path_on_cuda() -> None:
    assert check_kernel_path("cuda", SMALL + LARGE) == []


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("overlap", ["dw", "pipeline"])
def test_overlap_and_fp32_weight_grad_on_cuda(overlap: str) -> None:
    """The side-stream gradient matmuls and the fp32 accumulator: the same checks."""
    shapes = SMALL[:1] + LARGE[:1]
    assert check_kernel_path("cuda", shapes, overlap=overlap, dweight_fp32=True) == []


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_loss_replayed_as_a_cuda_graph(caplog) -> None:
    """``graph_loss``: core's loss (PPO-clip with entropy, REINFORCE with KL, sequence-mean) is
    captured on the second chunk and replayed for the others (several chunks: LARGE[:1] has
    six), with the same checks; a capture that fell back to eager calls is reported."""
    shapes = SMALL[:1] + LARGE[:1]
    with caplog.at_level("WARNING", logger="unirl.core.maths.head_loss"):
        failures = check_kernel_path("cuda", shapes, graph_loss=True, overlap="pipeline")
    assert failures == []
    assert "cannot be captured" not in caplog.text, caplog.text


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton) for its interpreter")
def test_kernel_path_in_the_interpreter() -> None:
    code = (
        "from tests.unit.test_head_loss_gpu import check_kernel_path, SMALL; "
        "import sys; f = check_kernel_path('cpu', SMALL); "
        # the fp32 weight-gradient accumulator (overlap needs CUDA streams: ignored here)
        "f += check_kernel_path('cpu', SMALL[:1], dweight_fp32=True, overlap='pipeline'); "
        "print(f); sys.exit(1 if f else 0)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
