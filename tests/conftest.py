"""The suite's two tiers. Tests marked ``slow`` (extra layouts of a feature whose main layout runs
anyway, the longest multi-process variants) are skipped unless asked for, so the README's test
command (what CI runs) stays near half an hour on two cores; ``--runslow`` (or
``UNIRL_RUN_SLOW=1``) runs every test."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--runslow", action="store_true", default=False, help="also run tests marked slow"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow") or os.environ.get("UNIRL_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow tier: run with --runslow (or UNIRL_RUN_SLOW=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
