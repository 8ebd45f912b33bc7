"""The LoRA contract (`tests/contract/lora.py`): ``model.lora`` on every backend that trains an
adapter, against the independent transformers + peft fp32 reference, with the fp32 tolerances.

On the CPU (CI) the layouts each LoRA-capable plug-in marks ``lora`` (`lora_layouts`: never
none); a backend joins by declaring ``supports_lora`` and marking layouts.

    python -m pytest tests/contract/test_lora.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.contract import clauses, lora
from tests.contract.backends import REGISTRY, lora_layouts, skip_reason

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
            params.append(
                pytest.param((entry, layout), id=f"{entry.name}-{layout.name}", marks=marks)
            )
    return params


def test_every_lora_capable_backend_gets_cases():
    """The cases come from the plug-ins' declared capability: every backend with
    ``supports_lora`` has some, one without has none, only dense layouts are marked, and a
    capable backend that marks none still gets its first dense layout."""
    with_cases = {param.values[0][0].name for param in _cases()}
    assert with_cases == {e.name for e in REGISTRY.values() if e.supports_lora}
    assert {"deepspeed", "fsdp2"} <= with_cases
    wrongly_marked = [
        f"{entry.name}/{layout.name}"
        for entry in REGISTRY.values()
        for layout in entry.layouts
        if layout.lora and not (entry.supports_lora and layout.fixture == "dense")
    ]
    assert wrongly_marked == []
    capable = next(e for e in REGISTRY.values() if e.supports_lora)
    unmarked = tuple(attrs.evolve(layout, lora=False) for layout in capable.layouts)
    new = attrs.evolve(capable, name="new-backend", layouts=unmarked)
    assert lora_layouts(new) == (next(x for x in unmarked if x.fixture == "dense"),)
    assert lora_layouts(attrs.evolve(new, supports_lora=False)) == ()


@pytest.fixture(scope="session")
def lora_adapter(tmp_path_factory: pytest.TempPathFactory, contract_data: Any) -> Path:
    from tests.contract.lora_reference import write_start_adapter

    return write_start_adapter(contract_data[0], tmp_path_factory.mktemp("lora") / "start")


@pytest.fixture(scope="session")
def lora_reference(contract_data: Any, lora_adapter: Path) -> lora.LoraReferenceResults:
    model_dir, records = contract_data
    return lora.compute_lora_reference(model_dir, lora_adapter, records)


class LoraRuns:
    """Each layout's LoRA group once per session."""

    def __init__(self, tmp: pytest.TempPathFactory, data: Any, adapter: Path) -> None:
        self._tmp, self._data, self._adapter = tmp, data, adapter
        self._done: dict[tuple[str, str], Any] = {}

    def get(self, entry: Any, layout: Any) -> clauses.Measured:
        key = (entry.name, layout.name)
        if key not in self._done:
            model_dir, records = self._data
            try:
                self._done[key] = lora.run_lora_group(
                    entry, layout, model_dir=model_dir, adapter=self._adapter, records=records,
                    work_dir=self._tmp.mktemp(f"lora-{entry.name}-{layout.name}"),
                )  # fmt: skip
            except BaseException as err:
                self._done[key] = err
        result = self._done[key]
        if isinstance(result, BaseException):
            pytest.fail(f"the LoRA group {key} did not finish: {result}", pytrace=False)
        return result


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory, contract_data, lora_adapter) -> LoraRuns:
    return LoraRuns(tmp_path_factory, contract_data, lora_adapter)


@pytest.fixture(scope="module", params=_cases())
def case(request: pytest.FixtureRequest) -> tuple:
    return request.param


@pytest.fixture
def group(case: tuple, lora_runs: LoraRuns) -> clauses.Measured:
    return lora_runs.get(*case)


def _assert(fn, *args) -> None:
    try:
        checks = fn(*args)
    except clauses.SectionFailed as err:
        pytest.fail(str(err), pytrace=False)
    failed = [c for c in checks if not c.ok]
    if failed:
        pytest.fail(
            f"{len(failed)} of {len(checks)} checks failed:\n"
            + "\n".join(c.describe() for c in failed[:40]),
            pytrace=False,
        )


def test_lora_l1_forward(group, lora_reference):
    _assert(lora.clause_l1_forward, group, lora_reference, TOL)


def test_lora_l2_step(group, lora_reference):
    _assert(lora.clause_l2_step, group, lora_reference, TOL)


def test_lora_l3_adapter_and_merged_weights(group, lora_reference):
    _assert(lora.clause_l3_adapter, group, lora_reference, TOL)


def test_lora_l4_microbatch_split(group):
    _assert(lora.clause_l4_microbatching, group, TOL)


def test_lora_l5_export_reloads_with_peft(group, contract_data):
    _assert(lora.clause_l5_export, group, contract_data[0], contract_data[1], TOL)


def _baseline(entry: Any) -> Any:
    return lora_layouts(entry)[0]


@pytest.mark.parametrize(
    "case", _cases(lambda entry, layout: layout != _baseline(entry)), scope="module"
)
def test_lora_l4_layouts_agree(case, group, lora_runs):
    """A layout that is not its backend's first LoRA layout gives that one's numbers."""
    entry, layout = case
    other = lora_runs.get(entry, _baseline(entry))
    _assert(
        lora.compare_lora_layouts, group, other, TOL, f"{layout.name} vs {_baseline(entry).name}"
    )


def _first_capable() -> Any:
    return next(entry for entry in REGISTRY.values() if lora_layouts(entry))


@pytest.mark.parametrize(
    "case",
    _cases(lambda e, layout: e.name != _first_capable().name and layout == _baseline(e)),
    scope="module",
)
def test_lora_l4_across_backends(case, group, lora_runs):
    """Each backend's first LoRA layout logs the first LoRA-capable backend's numbers."""
    first = _first_capable()
    entry, layout = case
    other = lora_runs.get(first, _baseline(first))
    label = f"{entry.name}/{layout.name} vs {first.name}/{_baseline(first).name}"
    _assert(lora.compare_lora_layouts, group, other, TOL, label)
