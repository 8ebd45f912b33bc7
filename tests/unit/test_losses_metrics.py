"""`reduce_metrics` sums numerators and denominators before dividing (over microbatches and,
through one all-reduce, over ranks); `sequence_sum` sums per sequence with gradients."""

from __future__ import annotations

import pytest
import torch

from tests.spawn import run_distributed
from unirl.core.errors import LossInputError
from unirl.core.maths.losses import Metric, reduce_metrics, sequence_mean, sequence_sum


def _m(num, den, kind="tokens"):
    return Metric(numerator=torch.tensor(num), denominator=den, kind=kind)


def test_reduce_sums_before_dividing():
    # clipfrac: microbatch 1 has 1 of 2 tokens clipped, microbatch 2 has 1 of 4:
    # (1 + 1) / (2 + 4) = 1/3, not the mean of means (0.5 + 0.25) / 2 = 0.375.
    # entropy only exists in microbatch 2: 6 / 4 = 1.5 (its absence elsewhere counts as 0 / 0).
    out = reduce_metrics(
        [
            {"pg_clipfrac": _m(1.0, torch.tensor(2.0))},
            {"pg_clipfrac": _m(1.0, 4.0), "entropy": _m(6.0, 4.0)},
        ]
    )
    assert out == pytest.approx({"pg_clipfrac": 1 / 3, "entropy": 1.5})


def test_zero_denominator_reports_zero_and_empty_input():
    assert reduce_metrics([{"kl": _m(0.0, 0.0)}]) == {"kl": 0.0}
    assert reduce_metrics([]) == {}


def test_kind_must_not_change():
    with pytest.raises(LossInputError, match="metric 'loss' is counted in tokens"):
        reduce_metrics([{"loss": _m(1.0, 1.0)}, {"loss": _m(1.0, 1.0, "sequences")}])


def test_sequence_sum_and_mean_single_rank():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], requires_grad=True)
    seq_ids = torch.tensor([1, 0, 1, 1, 0])
    sums = sequence_sum(values, seq_ids, 3)
    # seq0: 2 + 5 = 7; seq1: 1 + 3 + 4 = 8; seq2: nothing
    assert sums.tolist() == [7.0, 8.0, 0.0]
    (grad,) = torch.autograd.grad((sums * torch.tensor([10.0, 20.0, 30.0])).sum(), values)
    assert grad.tolist() == [20.0, 10.0, 20.0, 20.0, 10.0]
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])
    # seq0: (2 + 5) / 2; seq1: (1 + 4) / 4 with a global count of 4; seq2: 0 / max(0, 1)
    means = sequence_mean(values, mask, seq_ids, torch.tensor([2, 4, 0]))
    assert means.tolist() == pytest.approx([3.5, 1.25, 0.0])


def _two_ranks(rank: int, world_size: int) -> tuple[dict, list, list]:
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    # metrics: rank 0 clipped 1 of 2 and 0 of 3 tokens; rank 1 clipped 3 of 5
    per_rank = [
        [{"pg_clipfrac": _m(1.0, 2.0)}, {"pg_clipfrac": _m(0.0, 3.0)}],
        [{"pg_clipfrac": _m(3.0, 5.0)}],
    ]
    metrics = reduce_metrics(per_rank[rank], group=group)
    # sequence_sum over the "CP" group: both ranks hold tokens of sequences 0 and 1
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 20.0, 30.0]][rank], requires_grad=True)
    seq_ids = torch.tensor([[0, 1, 1], [1, 0, 0]][rank])
    sums = sequence_sum(values, seq_ids, 2, group)
    # each rank's loss weights the (replicated) sums differently
    weights = torch.tensor([[1.0, 2.0], [3.0, 4.0]][rank])
    (grad,) = torch.autograd.grad((sums * weights).sum(), values)
    return metrics, sums.tolist(), grad.tolist()


def test_two_ranks_gloo():
    results = run_distributed(_two_ranks, 2)
    for metrics, sums, _ in results:
        # (1 + 0 + 3) / (2 + 3 + 5) = 0.4 on every rank
        assert metrics == pytest.approx({"pg_clipfrac": 0.4})
        # seq0: 1 + 20 + 30 = 51; seq1: 2 + 3 + 10 = 15
        assert sums == [51.0, 15.0]
    # d(sum over ranks of weights_r . sums)/d values = summed weights of the token's sequence:
    # seq0 -> 1 + 3 = 4, seq1 -> 2 + 4 = 6
    assert results[0][2] == [4.0, 6.0, 6.0]
    assert results[1][2] == [6.0, 4.0, 4.0]
