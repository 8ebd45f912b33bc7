"""Vocabulary-parallel logprobs_from_logits on gloo (TP = 2, 4) against the unsharded fp64
reference: log-probs, entropy and each shard's gradient."""

from __future__ import annotations

import torch

from tests.logprob_reference import logits_reference
from tests.spawn import run_distributed

N_TOKENS = 10
TEMPERATURE = 0.8


def make_problem(
    vocab_local: int, tp: int, vocab_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full padded logits [T, vocab_local * tp], targets on every shard, and loss weights."""
    g = torch.Generator().manual_seed(100 + tp)
    logits = (torch.randn(N_TOKENS, vocab_local * tp, generator=g) * 3).to(dtype)
    logits[:, vocab_size:] = 40.0  # padding that would dominate the softmax if counted
    targets = torch.randint(0, vocab_size, (N_TOKENS,), generator=g)
    # make sure some targets land on every shard that holds real vocabulary
    for r in range(tp):
        first = r * vocab_local
        if first < vocab_size:
            targets[r] = first + min(vocab_local, vocab_size - first) - 1
    w_logp = torch.randn(N_TOKENS, generator=g)
    w_ent = torch.randn(N_TOKENS, generator=g)
    return logits, targets, w_logp, w_ent


DTYPES = (torch.float32, torch.bfloat16)
# (tp, vocab_local, vocab_size)
CASES = (
    # last shard holds 8 real ids and 3 padding columns
    (2, 11, 19),
    # shards [0,7) [7,14) [14,21) [21,28): the third holds 6 real ids, the fourth only padding
    (4, 7, 20),
)


def tp_worker(rank: int, world: int) -> list[list[dict]]:
    """One gloo world of 4 runs both cases: TP = 2 as groups {0, 1} and {2, 3}, and TP = 4."""
    import torch.distributed as dist

    out = []
    for tp, vocab_local, vocab_size in CASES:
        groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
        tp_rank, group = rank % tp, groups[rank // tp]
        out.append([one_rank(tp_rank, tp, vocab_local, vocab_size, dt, group) for dt in DTYPES])
    return out


def one_rank(
    rank: int, world: int, vocab_local: int, vocab_size: int, dtype: torch.dtype, group
) -> dict[str, list]:
    from unirl.core.maths.logprobs import logprobs_from_logits

    logits, targets, w_logp, w_ent = make_problem(vocab_local, world, vocab_size, dtype)
    shard = logits[:, rank * vocab_local : (rank + 1) * vocab_local].clone().requires_grad_(True)
    logp, entropy = logprobs_from_logits(
        shard,
        targets,
        tp_group=group,
        temperature=TEMPERATURE,
        vocab_size=vocab_size,
        chunk_size=3,
        with_entropy=True,
    )
    ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
    grad_both = shard.grad.clone()

    # the log-prob-only gradient, with the entropy computed but not differentiated
    shard.grad = None
    logp2, entropy2 = logprobs_from_logits(
        shard,
        targets,
        tp_group=group,
        temperature=TEMPERATURE,
        vocab_size=vocab_size,
        with_entropy=True,
        entropy_grad=False,
    )
    (w_logp * logp2).sum().backward()
    assert grad_both.dtype == dtype and not entropy2.requires_grad
    # plain lists: tensors would travel through shared memory that dies with the process
    out = {
        "logp": logp,
        "entropy": entropy,
        "grad_both": grad_both,
        "grad_logp": shard.grad,
        "entropy_no_grad": entropy2,
    }
    return {k: v.detach().double().tolist() for k, v in out.items()}


def reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unsharded fp64 log_softmax + gather, -sum p log p, and the gradient (0 on padding)."""
    return logits_reference(logits, targets, TEMPERATURE, vocab_size, w_logp, w_ent)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_vocab_parallel_matches_unsharded_fp64() -> None:
    results = run_distributed(tp_worker, 4)
    for c, (tp, vocab_local, vocab_size) in enumerate(CASES):
        for i, dtype in enumerate(DTYPES):
            per_rank = [results[r][c][i] for r in range(4)]
            # with TP = 2, ranks 2 and 3 form a second group and must agree with ranks 0 and 1
            check(tp, vocab_local, vocab_size, dtype, per_rank[:tp])
            check(tp, vocab_local, vocab_size, dtype, per_rank[tp : 2 * tp] or per_rank[:tp])


def check(tp: int, vocab_local: int, vocab_size: int, dtype: torch.dtype, results: list) -> None:
    logits, targets, w_logp, w_ent = make_problem(vocab_local, tp, vocab_size, dtype)
    ref_logp, ref_ent, ref_grad_both = reference(logits, targets, vocab_size, w_logp, w_ent)
    _, _, ref_grad_logp = reference(logits, targets, vocab_size, w_logp, None)
    grad_tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16 gradient: relative step 2**-8
    for rank, lists in enumerate(results):
        out = {k: torch.tensor(v, dtype=torch.float64) for k, v in lists.items()}
        cols = slice(rank * vocab_local, (rank + 1) * vocab_local)
        assert rel_err(out["logp"], ref_logp) < 1e-5, (rank, dtype)
        assert rel_err(out["entropy"], ref_ent) < 1e-5, rank
        assert rel_err(out["entropy_no_grad"], ref_ent) < 1e-5, rank
        grad_ref = ref_grad_both[:, cols]
        grad_ref_logp = ref_grad_logp[:, cols]
        if grad_ref.abs().sum() == 0:  # a shard of padding only
            assert torch.all(out["grad_both"] == 0) and torch.all(out["grad_logp"] == 0), rank
            continue
        assert rel_err(out["grad_both"], grad_ref) < grad_tol, rank
        assert rel_err(out["grad_logp"], grad_ref_logp) < grad_tol, rank
    # padding columns of the last real shard get exactly zero gradient
    last = torch.tensor(results[(vocab_size - 1) // vocab_local]["grad_both"])
    pad_from = vocab_size - ((vocab_size - 1) // vocab_local) * vocab_local
    assert torch.all(last[:, pad_from:] == 0)
