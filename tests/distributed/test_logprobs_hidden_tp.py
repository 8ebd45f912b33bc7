"""logprobs_from_hidden with the vocabulary sharded over TP = 2 (gloo), Megatron's padded
vocabulary included, against plain unsharded fp64 PyTorch (`tests.logprob_reference`): log-probs,
entropy, the full gradient of the (replicated) hidden states on every rank and each rank's
weight-shard gradient."""

from __future__ import annotations

import torch

from tests.logprob_reference import logp_entropy_backward
from tests.spawn import run_distributed

N_TOKENS, HIDDEN = 10, 12
TEMPERATURE = 0.8
# (vocab_local, vocab_size): 2 x 11 = 22 rows, the last shard holds 8 real ids and 3 padding rows;
# 2 x 10 = 20 rows with 9 real ids: the second shard is all padding
CASES = ((11, 19), (10, 9))
DTYPES = (torch.float32, torch.bfloat16)


def make_problem(vocab_local: int, vocab_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7 + vocab_local)
    hidden = torch.randn(N_TOKENS, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(2 * vocab_local, HIDDEN, generator=g) / HIDDEN**0.5 * 3).to(dtype)
    weight[vocab_size:] = weight[vocab_size:] * 30  # padding that would dominate if counted
    targets = torch.randint(0, vocab_size, (N_TOKENS,), generator=g)
    targets[0] = vocab_size - 1  # the last real id (on the last real shard)
    w_logp = torch.randn(N_TOKENS, generator=g)
    w_ent = torch.randn(N_TOKENS, generator=g)
    return hidden, weight, targets, w_logp, w_ent


def worker(rank: int, world: int) -> list[dict[str, list]]:
    from unirl.core.maths.logprobs_hidden import logprobs_from_hidden

    out = []
    for vocab_local, vocab_size in CASES:
        for dtype in DTYPES:
            hidden, weight, targets, w_logp, w_ent = make_problem(vocab_local, vocab_size, dtype)
            h = hidden.clone().requires_grad_(True)
            shard = weight[rank * vocab_local : (rank + 1) * vocab_local].clone()
            shard.requires_grad_(True)
            logp, entropy = logprobs_from_hidden(
                h,
                shard,
                targets,
                tp_group=torch.distributed.group.WORLD,
                temperature=TEMPERATURE,
                vocab_size=vocab_size,
                with_entropy=True,
                chunk_size=4,
            )
            ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
            res = {"logp": logp, "entropy": entropy, "dh": h.grad, "dw": shard.grad}
            out.append({k: v.detach().double().tolist() for k, v in res.items()})
    return out


def reference(hidden, weight, targets, w_logp, w_ent, vocab_size: int) -> dict[str, torch.Tensor]:
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logits = (h @ w.T)[:, :vocab_size] / TEMPERATURE
    logp, entropy = logp_entropy_backward(logits, targets, w_logp, w_ent)
    return {"logp": logp, "entropy": entropy, "dh": h.grad, "dw": w.grad}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_tp2_matches_unsharded_fp64() -> None:
    results = run_distributed(worker, 2)
    i = 0
    for vocab_local, vocab_size in CASES:
        for dtype in DTYPES:
            ref = reference(*make_problem(vocab_local, vocab_size, dtype), vocab_size)
            grad_tol = 1e-5 if dtype == torch.float32 else 8e-3
            for rank in range(2):
                out = {k: torch.tensor(v, dtype=torch.float64) for k, v in results[rank][i].items()}
                assert rel_err(out["logp"], ref["logp"]) < 1e-5, (rank, dtype)
                assert rel_err(out["entropy"], ref["entropy"]) < 1e-5, (rank, dtype)
                # every rank holds the full hidden-state gradient (summed over the shards)
                assert rel_err(out["dh"], ref["dh"]) < grad_tol, (rank, dtype)
                rows = slice(rank * vocab_local, (rank + 1) * vocab_local)
                real = max(0, min(vocab_local, vocab_size - rank * vocab_local))
                if real:
                    assert rel_err(out["dw"][:real], ref["dw"][rows][:real]) < grad_tol
                assert torch.all(out["dw"][real:] == 0), (rank, "padding rows")
            i += 1
