"""The LoRA contract (`tests/contract/lora.py`): ``model.lora`` on every backend that trains an
adapter, against the independent transformers + peft fp32 reference, with the fp32 tolerances.

On the CPU (CI) the layouts each LoRA-capable plug-in marks ``lora`` (`lora_layouts`: never
none); a backend joins by declaring ``supports_lora`` and marking layouts. A MoE layout marked
``lora`` runs with expert adapters against `tests.contract.lora_moe_reference`. A case is in the
slow tier where its layout's contract group is (`tests.contract.backends.SLOW_LAYOUTS`): when
both suites run (CI), a layout's LoRA job runs in its contract group's processes
(tests/contract/conftest.py) and adds no process start-up.

    python -m pytest tests/contract/test_lora.py -q
    python -m pytest tests/contract/test_lora.py -q -k moe --runslow   # expert adapters
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.contract import clauses, lora
from tests.contract.backends import REGISTRY, SLOW_LAYOUTS, lora_layouts, skip_reason

pytest.importorskip("peft")

TOL = clauses.TOLERANCES["fp32"]


def _cases(keep: Callable[[Any, Any], bool] = lambda entry, layout: True) -> list:
    params = []
    for entry in REGISTRY.values():
        for layout in lora_layouts(entry):
            if not keep(entry, layout):
                continue
            reason = skip_reason(entry, layout, device="cpu", devices_available=0)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            if layout.name in SLOW_LAYOUTS.get(entry.name, ()):
                marks.append(pytest.mark.slow)
            params.append(
                pytest.param((entry, layout), id=f"{entry.name}-{layout.name}", marks=marks)
            )
    return params


def test_every_lora_capable_backend_gets_cases():
    """The cases come from the plug-ins' declared capability: every backend with
    ``supports_lora`` has some, one without has none, Megatron's expert adapters run under
    EP 1 and EP 2 (grouped and sequential), a capable backend that marks none still gets its first dense layout and no
    MoE layout."""
    with_cases = {param.values[0][0].name for param in _cases()}
    assert with_cases == {e.name for e in REGISTRY.values() if e.supports_lora}
    assert {"deepspeed", "fsdp2"} <= with_cases
    names = {f"{e.name}/{x.name}" for e in REGISTRY.values() for x in lora_layouts(e)}
    assert {"megatron/moe-ep1-grouped", "megatron/moe-ep2-grouped", "megatron/moe-ep2"} <= names
    wrongly_marked = [
        f"{entry.name}/{layout.name}"
        for entry in REGISTRY.values()
        for layout in entry.layouts
        if layout.lora and not entry.supports_lora
    ]
    assert wrongly_marked == []
    capable = next(e for e in REGISTRY.values() if e.supports_lora)
    unmarked = tuple(attrs.evolve(layout, lora=False) for layout in capable.layouts)
    new = attrs.evolve(capable, name="new-backend", layouts=unmarked)
    assert lora_layouts(new) == (next(x for x in unmarked if x.fixture == "dense"),)
    assert lora_layouts(attrs.evolve(new, supports_lora=False)) == ()


class LoraRuns:
    """Each layout's LoRA group once per session: the one run with the layout's contract group
    when the contract tests ran it (tests/contract/conftest.py), else a group of its own."""

    def __init__(
        self, tmp: pytest.TempPathFactory, fixtures: lora.LoraFixtures, contract_runs: Any
    ) -> None:
        self._tmp, self._fixtures, self._contract_runs = tmp, fixtures, contract_runs
        self._done: dict[tuple[str, str], Any] = {}

    def get(self, entry: Any, layout: Any) -> clauses.Measured:
        key = (entry.name, layout.name)
        if key not in self._done:
            self._done[key] = self._contract_runs.companion("lora", entry, layout)
        if self._done[key] is None:
            model_dir, records = self._fixtures.data(layout.fixture)
            adapter = self._fixtures.adapter(layout.fixture)
            try:
                self._done[key] = lora.run_lora_group(
                    entry, layout, model_dir=model_dir, adapter=adapter, records=records,
                    work_dir=self._tmp.mktemp(f"lora-{entry.name}-{layout.name}"),
                )  # fmt: skip
            except BaseException as err:
                self._done[key] = err
        result = self._done[key]
        if isinstance(result, BaseException):
            pytest.fail(f"the LoRA group {key} did not finish: {result}", pytrace=False)
        return result


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory, lora_fixtures, contract_runs) -> LoraRuns:
    return LoraRuns(tmp_path_factory, lora_fixtures, contract_runs)


@pytest.fixture(scope="module", params=_cases())
def case(request: pytest.FixtureRequest) -> tuple:
    return request.param


@pytest.fixture
def group(case: tuple, lora_runs: LoraRuns) -> clauses.Measured:
    return lora_runs.get(*case)


@pytest.fixture
def reference(case: tuple, lora_fixtures: lora.LoraFixtures) -> lora.LoraReferenceResults:
    return lora_fixtures.reference(case[1].fixture)


@pytest.fixture
def data(case: tuple, lora_fixtures: lora.LoraFixtures) -> tuple[Path, list[dict[str, Any]]]:
    return lora_fixtures.data(case[1].fixture)


_assert = clauses.assert_checks


def test_lora_l1_forward(group, reference):
    _assert(lora.clause_l1_forward, group, reference, TOL)


def test_lora_l2_step(group, reference):
    _assert(lora.clause_l2_step, group, reference, TOL)


def test_lora_l3_adapter_and_merged_weights(group, reference):
    _assert(lora.clause_l3_adapter, group, reference, TOL)


def test_lora_l4_microbatch_split(group):
    _assert(lora.clause_l4_microbatching, group, TOL)


def test_lora_l5_export_reloads_with_peft(group, data):
    _assert(lora.clause_l5_export, group, data[0], data[1], TOL)


def _baseline(entry: Any, fixture: str) -> Any:
    """The backend's first LoRA layout of ``fixture``: the one its others of it equal."""
    return next(x for x in lora_layouts(entry) if x.fixture == fixture)


@pytest.mark.parametrize(
    "case",
    _cases(lambda entry, layout: layout != _baseline(entry, layout.fixture)),
    scope="module",
)
def test_lora_l4_layouts_agree(case, group, lora_runs):
    """A layout that is not its backend's first LoRA layout of its fixture gives that one's
    numbers."""
    entry, layout = case
    baseline = _baseline(entry, layout.fixture)
    other = lora_runs.get(entry, baseline)
    _assert(lora.compare_lora_layouts, group, other, TOL, f"{layout.name} vs {baseline.name}")


def _first_capable(fixture: str) -> Any:
    """The first backend with a LoRA layout of ``fixture``."""
    return next(e for e in REGISTRY.values() if any(x.fixture == fixture for x in lora_layouts(e)))


@pytest.mark.parametrize(
    "case",
    _cases(
        lambda e, layout: (
            e.name != _first_capable(layout.fixture).name and layout == _baseline(e, layout.fixture)
        )
    ),
    scope="module",
)
def test_lora_l4_across_backends(case, group, lora_runs):
    """Each backend's first LoRA layout of a fixture logs the numbers of the first backend with
    one."""
    entry, layout = case
    first = _first_capable(layout.fixture)
    baseline = _baseline(first, layout.fixture)
    label = f"{entry.name}/{layout.name} vs {first.name}/{baseline.name}"
    other = lora_runs.get(first, baseline)
    _assert(lora.compare_lora_layouts, group, other, TOL, label)
