"""The topology the Megatron backend builds equals megatron.core.parallel_state on gloo."""

import pytest

from tests.spawn import run_distributed

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install unirl[megatron])")


LAYOUTS = [(2, 2, 1, None), (1, 2, 1, 2), (1, 1, 2, None)]  # tp2-pp2, pp2-vpp2, cp2


def _read_all(rank, world):
    # one spawn for every layout: starting 4 processes that import megatron costs ~30 s on 2 cores
    return [_read(rank, world, *layout) for layout in LAYOUTS]


def _read(rank, world, tp, pp, cp, vpp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.topology import Topology

    initialize_parallel_state(ParallelConfig(tp=tp, pp=pp, cp=cp, vpp=vpp, world_size=world))
    topo = topology_from_parallel_state()
    predicted = Topology.from_rank(rank, world, tp=tp, pp=pp, cp=cp, vpp=vpp)

    def members(group):
        return sorted(dist.get_process_group_ranks(group))

    out = {
        "ranks": (topo.tp_rank, topo.pp_rank, topo.cp_rank, topo.dp_rank, topo.dp_cp_rank),
        "predicted": (
            predicted.tp_rank,
            predicted.pp_rank,
            predicted.cp_rank,
            predicted.dp_rank,
            predicted.dp_cp_rank,
        ),
        "megatron": (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_context_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_rank(with_context_parallel=True),
        ),
        "reporting": topo.is_reporting_rank,
        "megatron_last": ps.is_pipeline_last_stage(ignore_virtual=True),
        "groups": {
            name: members(getattr(topo.groups, name)) for name in ("tp", "pp", "cp", "dp", "dp_cp")
        },
        "vpp": topo.vpp_size,
    }
    ps.destroy_model_parallel()
    return out


def test_topology_matches_parallel_state():
    world = 4
    per_rank = run_distributed(_read_all, world)
    for i, layout in enumerate(LAYOUTS):
        _check_layout([per_rank[r][i] for r in range(world)], layout[3])


def _check_layout(results, vpp):
    reporting = [r for r, res in enumerate(results) if res["reporting"]]
    assert len(reporting) == 1
    for rank, res in enumerate(results):
        assert res["ranks"] == res["megatron"] == res["predicted"], rank
        assert res["vpp"] == vpp
        # the reporting rank is the one Megatron calls last stage with tp = dp = cp = 0
        t, _p, c, d, _ = res["megatron"]
        assert res["reporting"] == (res["megatron_last"] and t == 0 and c == 0 and d == 0)
        # group membership: ranks that share every coordinate but the group's own
        for name, coord in (("tp", 0), ("pp", 1), ("cp", 2), ("dp", 3)):
            expected = sorted(
                r
                for r, other in enumerate(results)
                if all(other["megatron"][i] == res["megatron"][i] for i in range(4) if i != coord)
            )
            assert res["groups"][name] == expected, (rank, name)
        expected_dpcp = sorted(
            r
            for r, other in enumerate(results)
            if other["megatron"][0] == t and other["megatron"][1] == res["megatron"][1]
        )
        assert res["groups"]["dp_cp"] == expected_dpcp
