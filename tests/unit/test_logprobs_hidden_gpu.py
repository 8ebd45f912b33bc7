"""The Triton path of logprobs_from_hidden (per-chunk kernels of
`unirl.core.maths.kernels.logprobs_triton`, cuBLAS matmuls) against fp64 plain PyTorch written
in `tests.unit.test_logprobs_hidden`: on a CUDA GPU, and on the CPU through Triton's interpreter
(``TRITON_INTERPRET=1``, in a child process) where triton is installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.unit.test_logprobs_hidden import make, reference, rel_err

HAS_TRITON = importlib.util.find_spec("triton") is not None
TEMPERATURE = 0.7
# (vocab rows, true vocabulary, chunk): several chunks with a ragged last one; padding rows
# (Megatron's padded vocabulary) across a chunk boundary; one chunk; the default chunk size
CASES = ((37, 37, 5), (37, 29, 4), (37, 37, 64), (1000, 997, None))


def check_triton_path(device: str) -> list[str]:
    """Every case in fp32 and bf16, with and without the entropy's gradient; returns failures."""
    from unirl.core.maths import logprobs_hidden
    from unirl.core.maths.kernels import logprobs_triton

    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        for vocab, n_ids, chunk in CASES:
            for entropy_grad in (True, False):
                hidden, weight, targets, w_logp, w_ent = make(13, 16, vocab, dtype, 3, n_ids)
                weight[n_ids:] *= 20  # padding that would dominate if counted
                args = [x.to(device) for x in (hidden, weight, targets, w_logp, w_ent)]
                h = args[0].clone().requires_grad_(True)
                w = args[1].clone().requires_grad_(True)
                if device == "cuda":
                    logp, ent = logprobs_hidden.logprobs_from_hidden(
                        h,
                        w,
                        args[2],
                        temperature=TEMPERATURE,
                        vocab_size=n_ids,
                        with_entropy=True,
                        entropy_grad=entropy_grad,
                        chunk_size=chunk,
                        kernel="triton",
                    )
                else:  # the public entry refuses CPU tensors for the kernels: the Function
                    logp, ent = logprobs_hidden._LogprobsFromHidden.apply(
                        h, w, args[2], None, 1 / TEMPERATURE, 0, n_ids, chunk or 128,
                        True, entropy_grad, logprobs_triton,
                    )  # fmt: skip
                loss = (args[3] * logp).sum() + ((args[4] * ent).sum() if entropy_grad else 0)
                loss.backward()
                ref = reference(
                    hidden,
                    weight,
                    targets,
                    w_logp,
                    w_ent if entropy_grad else None,
                    temperature=TEMPERATURE,
                    vocab_size=n_ids,
                )
                # the chunk logits are fp32 (also for bf16 inputs); bf16 gradients are rounded
                grad_tol = 2e-5 if dtype == torch.float32 else 8e-3
                errs = {
                    "logp": (rel_err(logp.cpu(), ref["logp"]), 2e-5),
                    "entropy": (rel_err(ent.cpu(), ref["entropy"]), 2e-5),
                    "dh": (rel_err(h.grad.cpu(), ref["dh"]), grad_tol),
                    "dw": (rel_err(w.grad[:n_ids].cpu(), ref["dw"][:n_ids]), grad_tol),
                }
                for key, (err, tol) in errs.items():
                    if not err < tol:
                        failures.append(f"{dtype} {vocab}/{n_ids}/{chunk} {key}: {err:.2e}")
                if not torch.all(w.grad[n_ids:] == 0):
                    failures.append(f"{dtype} {vocab}/{n_ids}/{chunk}: padding rows' gradient")
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_triton_path_on_cuda() -> None:
    assert check_triton_path("cuda") == []


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (pip install triton) for its interpreter")
def test_triton_path_in_the_interpreter() -> None:
    code = (
        "from tests.unit.test_logprobs_hidden_gpu import check_triton_path; "
        "import sys; f = check_triton_path('cpu'); print(f); sys.exit(1 if f else 0)"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
