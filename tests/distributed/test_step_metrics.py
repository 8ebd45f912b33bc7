"""Loss metrics exist on the last pipeline stage only; every stage must end up with them."""

from tests.spawn import run_distributed


def _broadcast(rank, world):
    import torch.distributed as dist

    from unirl.core.step import _from_last_stage

    group = dist.new_group(list(range(world)))  # the pipeline group: stage r = rank r
    mine = {"loss": 0.25, "pg_clipfrac": 0.5} if rank == world - 1 else {}
    return _from_last_stage(mine, group, world)


def test_metrics_reach_every_pipeline_stage():
    results = run_distributed(_broadcast, 3)
    assert results == [{"loss": 0.25, "pg_clipfrac": 0.5}] * 3
