"""The router's load-balancing gradient at transformers' init (``initializer_range`` 0.02:
near-uniform routing), on every backend's MoE layouts, against the fp32 reference
(`tests/contract/router_init.py`). The default tier runs each backend's first MoE layout; the
rest are in the slow tier.

    python -m pytest tests/contract/test_router_init.py -q [--runslow]
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.contract import clauses, router_init
from tests.contract.backends import REGISTRY, skip_reason

TOL = clauses.TOLERANCES["fp32"]


def _cases() -> list:
    params = []
    for entry in REGISTRY.values():
        moe = [layout for layout in entry.layouts if layout.fixture == "moe"]
        for i, layout in enumerate(moe):
            reason = skip_reason(entry, layout, device="cpu", devices_available=0)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            if i > 0:
                marks.append(pytest.mark.slow)
            params.append(
                pytest.param((entry, layout), id=f"{entry.name}-{layout.name}", marks=marks)
            )
    return params


@pytest.fixture(scope="session")
def router_init_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list]:
    return router_init.prepare(tmp_path_factory.mktemp("router-init-model"))


@pytest.mark.parametrize("case", _cases())
def test_router_gradient_at_transformers_init(case, router_init_data, tmp_path):
    entry, layout = case
    model_dir, records = router_init_data
    m = router_init.run_group(
        entry, layout, model_dir=model_dir, records=records, work_dir=tmp_path
    )

    def checks() -> list[clauses.Check]:
        split = clauses.training_split(m, lambda r: r["splits"])
        ref = router_init.reference_step(model_dir, records, split)
        return router_init.checks(m, ref, TOL)

    clauses.assert_checks(checks)
