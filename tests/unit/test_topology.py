import itertools

import pytest

from unirl.core.errors import ConfigError
from unirl.core.topology import Topology

LAYOUTS = [
    # (world, tp, pp, cp, vpp)
    (1, 1, 1, 1, None),
    (4, 2, 2, 1, None),
    (4, 1, 2, 1, 2),
    (4, 1, 1, 2, None),
    (8, 2, 2, 2, 2),
    (16, 2, 2, 2, None),
    (8, 1, 4, 1, 2),
]


def _expected_coords(world, tp, pp, cp):
    """Megatron's default order tp-cp-ep-dp-pp, enumerated with nested loops (pp outermost)."""
    dp = world // (tp * pp * cp)
    coords = {}
    rank = 0
    for p in range(pp):
        for d in range(dp):
            for c in range(cp):
                for t in range(tp):
                    coords[rank] = (t, p, c, d)
                    rank += 1
    return coords, dp


@pytest.mark.parametrize("world,tp,pp,cp,vpp", LAYOUTS)
def test_from_rank_matches_megatron_order_and_predicates(world, tp, pp, cp, vpp):
    coords, dp = _expected_coords(world, tp, pp, cp)
    reporters = []
    for rank in range(world):
        topo = Topology.from_rank(rank, world, tp=tp, pp=pp, cp=cp, vpp=vpp)
        t, p, c, d = coords[rank]
        assert (topo.tp_rank, topo.pp_rank, topo.cp_rank, topo.dp_rank) == (t, p, c, d)
        assert topo.dp_size == dp and topo.dp_cp_size == dp * cp
        assert topo.dp_cp_rank == d * cp + c
        last = p == pp - 1
        assert topo.is_last_pipeline_stage() == last
        assert topo.is_first_pipeline_stage() == (p == 0)
        if topo.is_reporting_rank:
            reporters.append(rank)
        stages = vpp or 1
        for v in range(stages):
            expected = last and v == stages - 1
            assert topo.counts_microbatch(v if vpp else None) == expected
            assert topo.is_last_pipeline_stage(v) == expected
            assert topo.is_first_pipeline_stage(v) == (p == 0 and v == 0)
    # exactly one reporting rank: dp=cp=tp=0 on the last stage, i.e. the first rank of that stage
    assert reporters == [(pp - 1) * (world // pp)]


def test_every_microbatch_counted_once_under_vpp():
    """Simulate a VPP schedule: each rank runs every microbatch once per model chunk."""
    world, pp, vpp, microbatches = 4, 2, 2, 4
    ticks = 0
    for rank in range(world):
        topo = Topology.from_rank(rank, world, pp=pp, vpp=vpp)
        for _mb, chunk in itertools.product(range(microbatches), range(vpp)):
            ticks += topo.is_reporting_rank and topo.counts_microbatch(chunk)
    assert ticks == microbatches


def test_single_process_default():
    topo = Topology.single_process()
    assert topo.world_size == 1 and topo.is_reporting_rank and topo.counts_microbatch()


def test_invalid_layouts_name_the_problem():
    with pytest.raises(ConfigError, match="not divisible"):
        Topology.from_rank(0, 6, tp=4)
    with pytest.raises(ConfigError, match="does not equal the world size"):
        Topology(world_size=4, tp_size=2)
    with pytest.raises(ConfigError, match="vpp_size=2 needs pp_size > 1"):
        Topology(vpp_size=2)
    with pytest.raises(ConfigError, match="tp_rank=2 outside"):
        Topology(world_size=2, tp_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="needs vp_stage"):
        Topology.from_rank(1, 2, pp=2, vpp=2).counts_microbatch()


def test_expert_view():
    """Without expert parallel the expert view is the dense one (a DeepSpeed-style topology
    gives only dense sizes); with it, megatron's expert order etp-ep-edp-pp, written out for
    world 8, tp 2, pp 2, ep 2, etp 1: within a stage of 4 ranks, ep = r % 2, edp = r // 2."""
    dense = Topology(world_size=4, rank=3, dp_size=4, dp_rank=3)
    assert (dense.ep_size, dense.etp_size, dense.edp_size) == (1, 1, 4)
    assert (dense.ep_rank, dense.etp_rank, dense.edp_rank) == (0, 0, 3)
    views = [Topology.from_rank(r, 8, tp=2, pp=2, ep=2, etp=1) for r in range(8)]
    assert [(t.ep_rank, t.edp_rank, t.pp_rank) for t in views] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0),
        (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1),
    ]  # fmt: skip
    assert {(t.edp_size, t.etp_size, t.tp_rank == r % 2) for r, t in enumerate(views)} == {
        (2, 1, True)
    }
    # the reporting rank and the microbatch ticks ignore the expert view
    assert [t.is_reporting_rank for t in views] == [r == 4 for r in range(8)]
    with pytest.raises(ConfigError, match=r"parallel\.etp x parallel\.ep x parallel\.pp"):
        Topology.from_rank(0, 4, ep=3)
    with pytest.raises(ConfigError, match="expert layout"):
        Topology(world_size=2, dp_size=2, ep_size=2, edp_size=2)
