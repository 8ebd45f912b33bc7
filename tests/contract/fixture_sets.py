"""The contract suite's fixture models by name (`ContractLayout.fixture`): ``dense``, the tiny
Llama of `tests.contract.fixtures`, and ``moe``, the tiny Qwen3-MoE of
`tests.contract.moe_fixture`. Both share the batch, the optimizer and the resume run; each has
its own variants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.contract import fixtures, moe_fixture

FIXTURES = ("dense", "moe")
# The session fixtures (tests/contract/conftest.py) with each one's (model folder, records).
DATA_FIXTURES = {"dense": "contract_data", "moe": "moe_contract_data"}


def write_model(fixture: str, root: Path) -> Path:
    """The fixture's model folder under ``root``."""
    if fixture == "moe":
        return moe_fixture.write_tiny_moe(root / "tiny-qwen3-moe")
    return fixtures.write_tiny_model(root / "tiny-llama")


def base_overrides(fixture: str) -> dict[str, Any]:
    """What the fixture adds to `fixtures.base_config` (every variant and the build see it)."""
    return moe_fixture.BASE if fixture == "moe" else {}


def variants(fixture: str) -> dict[str, dict[str, Any]]:
    return moe_fixture.VARIANTS if fixture == "moe" else fixtures.VARIANTS


def all_variant_names() -> list[str]:
    """Every fixture's variant names, each once (the tests' parameters)."""
    return list(dict.fromkeys(n for f in FIXTURES for n in variants(f)))
