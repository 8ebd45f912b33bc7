"""The Megatron pipeline weight stream's failures, on 2 gloo processes (pp 2, the world as the
pipeline group): a stage whose bucket is not one flat buffer, or whose bucket making raises,
makes every rank raise the same error, after the buckets sent before it arrived intact, and
leaves no rank in a broadcast (the test finishes within run_distributed's timeout, and one
all-reduce afterwards sums both ranks' values). Before, the sending rank raised after the
specs' broadcast and its peer waited in the buffer's broadcast for ever."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)


def _flat(name: str, values: list[float]):
    """One flat bucket (a `FlatBucket`'s tensors) holding ``values`` under ``name``."""
    from unirl.core.weights.stream import FlatBucket, TensorSpec

    bucket = FlatBucket([TensorSpec(name, (len(values),), torch.float32)], torch.device("cpu"))
    bucket.slots[0].copy_(torch.tensor(values))
    return bucket.tensors()


def _stage_buckets(stage: int, failure: str):
    """Stage 0 sends one good bucket; stage 1 one good bucket, then fails as ``failure`` says."""
    yield _flat(f"stage{stage}.a", [float(stage), 1.0])
    if stage == 0:
        return
    if failure == "not-flat":  # two separate tensors: no one buffer to broadcast
        yield [("stage1.b", torch.ones(2)), ("stage1.c", torch.zeros(3))]
    else:
        raise RuntimeError("the planned shapes and the gathers disagree")


def _stream(rank: int, world: int, failure: str, dst: int | None) -> dict:
    import torch.distributed as dist

    from unirl.backends.megatron.weights.stream import _pipeline_buckets
    from unirl.core.topology import ProcessGroups, Topology

    topology = Topology.from_rank(rank, world, pp=2, groups=ProcessGroups(pp=dist.group.WORLD))
    cpu = torch.device("cpu")
    received: list[tuple[str, list[float]]] = []
    error = None
    try:
        keep = dst is None or dst == rank
        stream = _pipeline_buckets(
            lambda where: _stage_buckets(topology.pp_rank, failure), topology, cpu, keep, cpu, dst
        )
        for bucket in stream:
            received.extend((n, t.tolist()) for n, t in bucket)
    except RuntimeError as err:
        error = (str(err), None if err.__cause__ is None else str(err.__cause__))
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # both ranks reach it: neither is left in the stream's broadcasts
    return {"received": received, "error": error, "total": total.item()}


@pytest.mark.parametrize(
    ("failure", "message", "cause"),
    [
        (
            "not-flat",
            "weight stream: pipeline stage 1's bucket of 2 tensors is not one flat buffer, so "
            "it cannot be broadcast as one; planned_buckets makes flat buckets: the stage's "
            "buckets came from elsewhere",
            None,
        ),
        (
            "raises",
            "weight stream: pipeline stage 1 failed: RuntimeError: the planned shapes and the "
            "gathers disagree",
            "the planned shapes and the gathers disagree",
        ),
    ],
    ids=["not-flat", "raises"],
)
@pytest.mark.parametrize("dst", [None, 0], ids=["to-every-rank", "to-rank0"])
def test_a_failing_stage_raises_on_every_rank(failure, message, cause, dst):
    """Broadcast to every rank or sent to rank 0 alone: the sending stage's failure reaches
    every rank that waits for it, none is left waiting."""
    ranks = run_distributed(_stream, 2, failure, dst, timeout=90)
    for rank, out in enumerate(ranks):
        # stage 0's bucket, then stage 1's first one, on every receiving rank; then the error
        want = [("stage0.a", [0.0, 1.0]), ("stage1.a", [1.0, 1.0])]
        assert out["received"] == (want if dst in (None, rank) else []), rank
        assert out["error"] is not None, rank
        assert out["error"][0] == message, rank
        # the sending rank keeps its own error as the cause; the other only has the text
        assert out["error"][1] == (cause if rank == 1 else None), rank
        assert out["total"] == 3.0  # 1 + 2
