"""The critic's contract (`tests/contract/critic.py`): PPO's value model on every backend that
builds one, against the independent fp32 reference, with the GPU tolerances (1e-5).

On the CPU (CI) the layouts each critic-capable plug-in marks ``critic`` keep the added time
near a minute (`critic_layouts`: never none); the GPU runners (`benchmarks/contract_table.py`,
`benchmarks/megatron_contract.py`) run every layout.

    python -m pytest tests/contract/test_critic.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from tests.contract import clauses, critic
from tests.contract.backends import REGISTRY, critic_layouts, skip_reason

TOL = clauses.TOLERANCES["fp32"]


def _cases(keep: Callable[[Any, Any], bool] = lambda entry, layout: True) -> list:
    """The CPU layouts of every backend that builds a critic, those ``keep`` selects."""
    params = []
    for entry in REGISTRY.values():
        for layout in critic_layouts(entry):
            if not keep(entry, layout):
                continue
            reason = skip_reason(entry, layout, device="cpu", devices_available=0)
            marks = [pytest.mark.skip(reason=reason)] if reason else []
            params.append(
                pytest.param((entry, layout), id=f"{entry.name}-{layout.name}", marks=marks)
            )
    return params


def test_every_critic_capable_backend_gets_cases():
    """The cases come from the plug-ins' declared capability, not from a list of names: every
    registered backend with ``supports_critic`` has some, one without has none, only dense
    layouts of a capable backend are marked ``critic``, and a capable backend that marks none
    (a new one) still gets its first dense layout."""
    with_cases = {param.values[0][0].name for param in _cases()}
    assert with_cases == {e.name for e in REGISTRY.values() if e.supports_critic}
    wrongly_marked = [
        f"{entry.name}/{layout.name}"
        for entry in REGISTRY.values()
        for layout in entry.layouts
        if layout.critic and not (entry.supports_critic and layout.fixture == "dense")
    ]
    assert wrongly_marked == []
    capable = next(e for e in REGISTRY.values() if e.supports_critic)
    unmarked = tuple(attrs.evolve(layout, critic=False) for layout in capable.layouts)
    new = attrs.evolve(capable, name="new-backend", layouts=unmarked)
    first_dense = next(layout for layout in unmarked if layout.fixture == "dense")
    assert critic_layouts(new) == (first_dense,)
    assert critic_layouts(attrs.evolve(new, supports_critic=False)) == ()


class CriticRuns:
    """Each layout's critic group once per session: the one run with the layout's contract group
    when the contract tests ran it (tests/contract/conftest.py), else a group of its own."""

    def __init__(self, tmp: pytest.TempPathFactory, data: Any, contract_runs: Any) -> None:
        self._tmp, self._data, self._contract_runs = tmp, data, contract_runs
        self._done: dict[tuple[str, str], Any] = {}

    def get(self, entry: Any, layout: Any) -> clauses.Measured:
        key = (entry.name, layout.name)
        if key not in self._done:
            self._done[key] = self._contract_runs.companion("critic", entry, layout)
        if self._done[key] is None:
            model_dir, records = self._data
            try:
                self._done[key] = critic.run_critic_group(
                    entry,
                    layout,
                    model_dir=model_dir,
                    records=records,
                    work_dir=self._tmp.mktemp(f"critic-{entry.name}-{layout.name}"),
                )
            except BaseException as err:
                self._done[key] = err
        result = self._done[key]
        if isinstance(result, BaseException):
            pytest.fail(f"the critic group {key} did not finish: {result}", pytrace=False)
        return result


@pytest.fixture(scope="session")
def critic_runs(
    tmp_path_factory: pytest.TempPathFactory, contract_data: Any, contract_runs: Any
) -> CriticRuns:
    return CriticRuns(tmp_path_factory, contract_data, contract_runs)


@pytest.fixture(scope="session")
def critic_reference(contract_data: Any) -> critic.CriticReferenceResults:
    model_dir, records = contract_data
    return critic.compute_critic_reference(model_dir, records)


@pytest.fixture(scope="module", params=_cases())
def case(request: pytest.FixtureRequest) -> tuple:
    return request.param


@pytest.fixture  # a look-up (the runs are cached per layout): see test_contract.group
def group(case: tuple, critic_runs: CriticRuns) -> clauses.Measured:
    return critic_runs.get(*case)


_assert = clauses.assert_checks


def test_critic_c1_values(group, critic_reference):
    _assert(critic.clause_c1_values, group, critic_reference, TOL)


def test_critic_c2_value_loss_and_grad_norm(group, critic_reference):
    _assert(critic.clause_c2_step, group, critic_reference, TOL)


def test_critic_c3_values_after_step(group, critic_reference):
    _assert(critic.clause_c3_values_after, group, critic_reference, TOL)


def test_critic_c4_microbatch_split(group):
    _assert(critic.clause_c4_microbatching, group, TOL)


def _baseline(entry: Any) -> Any:
    """The backend's first critic layout: the one its other layouts equal."""
    return critic_layouts(entry)[0]


@pytest.mark.parametrize(
    "case", _cases(lambda entry, layout: layout != _baseline(entry)), scope="module"
)
def test_critic_c4_data_parallel_size(case, group, critic_runs):
    """A layout that is not its backend's baseline gives the baseline's numbers directly."""
    entry, layout = case
    baseline = _baseline(entry)
    other = critic_runs.get(entry, baseline)
    label = f"{layout.name} vs {baseline.name}"
    _assert(critic.compare_critic_layouts, group, other, TOL, label)


def _first_capable() -> Any:
    """The first backend with critic layouts: the one every other backend's critic equals."""
    return next(entry for entry in REGISTRY.values() if critic_layouts(entry))


@pytest.mark.parametrize(
    "case",
    _cases(
        lambda entry, layout: entry.name != _first_capable().name and layout == _baseline(entry)
    ),
    scope="module",
)
def test_critic_c6_across_backends(case, group, critic_runs):
    """Each backend's first critic layout logs the same metrics as the first critic-capable
    backend's, every one of them (on top of both matching the reference: a metric the reference
    does not compute is still compared here), each within its kind's tolerance."""
    first = _first_capable()
    reason = skip_reason(first, _baseline(first), device="cpu", devices_available=0)
    if reason:
        pytest.skip(f"{first.name}, the baseline backend, cannot run here: {reason}")
    entry, layout = case
    other = critic_runs.get(first, _baseline(first))
    label = f"{entry.name}/{layout.name} vs {first.name}/{_baseline(first).name}"
    _assert(critic.compare_critic_layouts, group, other, TOL, label)


def test_critic_c5_hf_export(group, contract_data):
    _assert(critic.clause_c5_export, group, contract_data[1], TOL)
