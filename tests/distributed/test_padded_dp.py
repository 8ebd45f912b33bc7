"""The padded API's data-parallel rule on gloo: two ranks, each with half the rows, pass the
all-reduced counts (`unirl.losses.global_counts`); their losses add up to the one-process loss
of the whole batch, and each rank's gradient is its rows' share of the whole batch's gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed
from unirl.core.maths.losses import LossSettings
from unirl.losses import global_counts, policy_loss

SETTINGS = {
    "token-mean": LossSettings(clip_high=0.28, dual_clip=3.0),
    "seq-mean-token-mean": LossSettings(policy_loss="gspo", loss_aggregation="seq-mean-token-mean"),
}


def _batch():
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 2, 0, 4, 1, 3])  # row 2: an empty response
    mask = torch.arange(5)[None, :] < lengths[:, None]
    logp = -torch.rand(6, 5, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def _rank(rank: int, world_size: int, mode: str) -> tuple[float, torch.Tensor, tuple[int, int]]:
    logp, old, adv, mask = _batch()
    rows = slice(rank * 3, rank * 3 + 3)
    local = logp[rows].clone().requires_grad_()
    tokens, sequences = global_counts(mask[rows], group=dist.group.WORLD)
    loss, _ = policy_loss(
        SETTINGS[mode].policy_loss, local, old[rows], adv[rows], mask[rows],
        settings=SETTINGS[mode], global_tokens=tokens, global_sequences=sequences,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, local)
    return loss.item(), grad, (tokens, sequences)


@pytest.mark.parametrize("mode", list(SETTINGS))
def test_rank_shares_add_up_to_the_whole_batch(mode):
    results = run_distributed(_rank, 2, mode)
    logp, old, adv, mask = _batch()
    whole = logp.clone().requires_grad_()
    loss, _ = policy_loss(
        SETTINGS[mode].policy_loss, whole, old, adv, mask, settings=SETTINGS[mode]
    )
    (grad,) = torch.autograd.grad(loss, whole)
    assert [r[2] for r in results] == [(int(mask.sum()), 5)] * 2  # 5: the empty row not counted
    assert sum(r[0] for r in results) == pytest.approx(loss.item(), abs=1e-12)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), grad, rtol=1e-12, atol=1e-12)
