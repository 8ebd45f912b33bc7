"""head_loss with the vocabulary sharded over TP = 2 (gloo), Megatron's padded vocabulary
included, against the unsharded fp64 reference of `tests.unit.test_head_loss` (full logits,
log_softmax, the loss formula written out, autograd): the loss and log-probs on every rank, the
full gradient of the (replicated) hidden states on every rank and each rank's weight-shard
gradient."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.spawn import run_distributed

N_TOKENS, HIDDEN = 10, 12
TEMPERATURE = 0.8
# (vocab_local, vocab_size): 2 x 11 rows, the last shard holds 8 real ids and 3 padding rows;
# 2 x 10 rows with 9 real ids: the second shard is all padding
SHARDS = ((11, 19), (10, 9))
DTYPES = (torch.float64, torch.float32)


def worker(rank: int, world: int, kernels: bool = False) -> list[dict[str, list]]:
    """Every case on this rank: the public entry (PyTorch path), or with ``kernels`` the inner
    call with the Triton kernels (Triton's interpreter on the CPU), fp32 then."""
    from tests.unit.test_head_loss import CASES, core_loss, make
    from unirl.core.maths import head_loss as hl

    out = []
    for vocab_local, vocab_size in SHARDS:
        for dtype in (torch.float32,) if kernels else DTYPES:
            for case in sorted(CASES):
                settings = CASES[case][1]
                p = make(N_TOKENS, HIDDEN, 2 * vocab_local, dtype, 7, vocab_size)
                h = p["hidden"].clone().requires_grad_(True)
                shard = p["weight"][rank * vocab_local : (rank + 1) * vocab_local].clone()
                shard.requires_grad_(True)
                group = torch.distributed.group.WORLD
                entropy_grad = settings.entropy_coef != 0
                if kernels:
                    from unirl.core.maths.kernels import logprobs_triton

                    res = hl._head_loss(
                        h, shard, p["targets"], core_loss(p, settings), group=group,
                        inv_temp=1 / TEMPERATURE, vocab_start=rank * vocab_local,
                        n_valid=max(0, min(vocab_local, vocab_size - rank * vocab_local)),
                        chunk=4, with_entropy=True, entropy_grad=entropy_grad,
                        kernels=logprobs_triton,
                    )  # fmt: skip
                else:
                    res = hl.head_loss(
                        h,
                        shard,
                        p["targets"],
                        core_loss(p, settings),
                        tp_group=group,
                        temperature=TEMPERATURE,
                        vocab_size=vocab_size,
                        with_entropy=True,
                        entropy_grad=entropy_grad,
                        chunk_size=4,
                    )
                res.loss.backward()
                got = {"loss": res.loss, "logp": res.logprobs, "dh": h.grad, "dw": shard.grad}
                out.append({k: v.detach().double().tolist() for k, v in got.items()})
    return out


def check(results: list, dtypes: tuple[torch.dtype, ...]) -> None:
    from tests.unit.test_head_loss import CASES, make, reference, rel_err

    i = 0
    for vocab_local, vocab_size in SHARDS:
        for dtype in dtypes:
            for case in sorted(CASES):
                p = make(N_TOKENS, HIDDEN, 2 * vocab_local, dtype, 7, vocab_size)
                ref = reference(p, CASES[case][0], temperature=TEMPERATURE, vocab_size=vocab_size)
                tol = 1e-10 if dtype == torch.float64 else 1e-4
                for rank in range(2):
                    got = {
                        k: torch.tensor(v, dtype=torch.float64) for k, v in results[rank][i].items()
                    }
                    where = (vocab_local, dtype, case, rank)
                    assert rel_err(got["loss"], ref["loss"]) < tol, where
                    assert rel_err(got["logp"], ref["logp"]) < tol, where
                    # every rank holds the full hidden-state gradient (summed over the shards)
                    assert rel_err(got["dh"], ref["dh"]) < tol, where
                    rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
                    real = max(0, min(vocab_local, vocab_size - rank * vocab_local))
                    if real:
                        assert rel_err(got["dw"][:real], ref["dw"][rows][:real]) < tol, where
                    assert torch.all(got["dw"][real:] == 0), (where, "padding rows")
                i += 1


def test_tp2_matches_unsharded_fp64() -> None:
    check(run_distributed(worker, 2), DTYPES)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton for its interpreter"
)
def test_tp2_kernels_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' path under TP (per-chunk all-reduces, the fp32 sum of the hidden-state
    gradient, an all-padding shard), in Triton's interpreter in the spawned ranks."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    check(run_distributed(worker, 2, True), (torch.float32,))
