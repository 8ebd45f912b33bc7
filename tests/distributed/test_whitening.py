"""Masked whitening of a batch split over 2 gloo ranks equals whitening the whole batch."""

from __future__ import annotations

import torch

from tests.spawn import run_distributed

ROWS, COLS = 7, 6
SPLIT = 3  # rank 0 holds rows [0, 3), rank 1 rows [3, 7): unequal shares


def make_batch():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(ROWS, COLS, generator=g, dtype=torch.float64) * 2.0 + 0.7
    mask = torch.rand(ROWS, COLS, generator=g) > 0.35
    mask[1] = False  # an empty row on rank 0
    rewards = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return x, mask, rewards


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from unirl.core.maths.advantages import (
        AdvantageInputs,
        AdvantageSettings,
        compute_advantages,
        masked_whiten,
    )

    x, mask, rewards = make_batch()
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, ROWS)
    group = dist.group.WORLD
    whitened = masked_whiten(x[rows], mask[rows], group=group)
    scaled = masked_whiten(x[rows].float(), mask[rows], group=group, shift_mean=False)
    # REINFORCE++ whitens over the batch: its advantages must not depend on the split either.
    inp = AdvantageInputs(
        rewards=rewards[rows],
        group_ids=torch.arange(ROWS)[rows],
        response_mask=mask[rows],
    )
    adv = compute_advantages(inp, AdvantageSettings(estimator="reinforce_pp"), group=group)
    return {
        "whitened": whitened.tolist(),
        "scaled": scaled.tolist(),
        "reinforce_pp": adv.advantages.tolist(),
    }


def gather(results, key, dtype=torch.float64):
    return torch.cat([torch.tensor(r[key], dtype=dtype) for r in results])


def test_masked_whiten_over_two_ranks_equals_whole_batch():
    results = run_distributed(_worker, 2)
    x, mask, rewards = make_batch()

    # plain-torch reference on the concatenated batch: unbiased variance over valid entries
    valid = x[mask]
    mean, var = valid.mean(), valid.var(unbiased=True)
    expected = torch.where(mask, (x - mean) / torch.sqrt(var + 1e-8), 0.0)
    torch.testing.assert_close(gather(results, "whitened"), expected)
    expected_scaled = torch.where(mask, expected + mean, 0.0).float()
    torch.testing.assert_close(gather(results, "scaled", torch.float32), expected_scaled)

    # REINFORCE++ with gamma 1 and no token rewards: each valid token's return is its sample's
    # reward (rows with no valid token contribute nothing), then whitened over all ranks.
    returns = torch.where(mask, rewards[:, None], 0.0)
    r_valid = returns[mask]
    expected_pp = torch.where(
        mask, (returns - r_valid.mean()) / torch.sqrt(r_valid.var(unbiased=True) + 1e-8), 0.0
    )
    torch.testing.assert_close(gather(results, "reinforce_pp"), expected_pp)
