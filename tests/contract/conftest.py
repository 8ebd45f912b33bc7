"""Session fixtures of the contract suite: the tiny models on disk (dense and MoE, each built
only when a layout of it runs), the rollout records, the independent references (the dense one
computed once; the MoE one per microbatch split, `clauses.MoeReferences`), and one cached run per
(backend, layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.contract import clauses, fixture_sets, launch, multiturn
from tests.contract.backends import BackendEntry, Layout

_TIMINGS: list[tuple[str, float, dict[str, float]]] = []


@pytest.fixture(scope="session")
def contract_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """(model folder, rollout records)."""
    return launch.prepare(tmp_path_factory.mktemp("contract-model"))


@pytest.fixture(scope="session")
def moe_contract_data(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[dict[str, Any]]]:
    """(MoE model folder, rollout records of its log-probs)."""
    return launch.prepare(tmp_path_factory.mktemp("contract-moe-model"), "moe")


@pytest.fixture(scope="session")
def moe_references(moe_contract_data: tuple[Path, list[dict[str, Any]]]) -> clauses.MoeReferences:
    return clauses.MoeReferences(*moe_contract_data)


@pytest.fixture(scope="session")
def contract_reference(
    contract_data: tuple[Path, list[dict[str, Any]]],
) -> clauses.ReferenceResults:
    model_dir, records = contract_data
    return clauses.compute_reference(model_dir, records)


@pytest.fixture(scope="session")
def contract_multiturn_reference(
    contract_data: tuple[Path, list[dict[str, Any]]],
) -> dict[str, Any]:
    """The per-turn loop's step on the multi-turn batch (`tests.contract.multiturn`)."""
    return multiturn.reference_step(*contract_data)


def _critic_cases_collected(session: pytest.Session) -> set[tuple[str, str]]:
    """(backend, layout) of every critic case (tests/contract/test_critic.py) this session runs."""
    found = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if (
            item.path.name == "test_critic.py"
            and callspec is not None
            and "case" in callspec.params
            and item.get_closest_marker("skip") is None
        ):
            entry, layout = callspec.params["case"]
            found.add((entry.name, layout.name))
    return found


class GroupRuns:
    """Runs each (backend, layout) group once per session and keeps its results (or error). A
    layout the session's critic tests also run gets the critic's job in the same processes
    (`launch.run_group_with_critic`); `critic` hands its results to those tests."""

    def __init__(self, tmp: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
        self._tmp = tmp
        self._request = request
        self._done: dict[tuple[str, str], clauses.Measured | BaseException] = {}
        self._critic: dict[tuple[str, str], clauses.Measured | BaseException] = {}
        self._with_critic = _critic_cases_collected(request.session)

    def critic(
        self, entry: BackendEntry, layout: Layout
    ) -> clauses.Measured | BaseException | None:
        """The critic's measurements of a layout run together with its contract group, or
        None (then the critic tests start a group of their own)."""
        return self._critic.get((entry.name, layout.name))

    def get(self, entry: BackendEntry, layout: Layout) -> clauses.Measured:
        key = (entry.name, layout.name)
        if key not in self._done:
            model_dir, records = self._request.getfixturevalue(
                fixture_sets.DATA_FIXTURES[layout.fixture]
            )
            work_dir = self._tmp.mktemp(f"{entry.name}-{layout.name}")
            try:
                if key in self._with_critic and layout.fixture == "dense":
                    measured, critic = launch.run_group_with_critic(
                        entry,
                        layout,
                        model_dir=model_dir,
                        records=records,
                        work_dir=work_dir,
                        critic_work_dir=self._tmp.mktemp(f"critic-{entry.name}-{layout.name}"),
                    )
                    self._critic[key] = critic
                    name = f"{entry.name}/{layout.name} (+ critic)"
                else:
                    measured = launch.run_group(
                        entry, layout, model_dir=model_dir, records=records, work_dir=work_dir
                    )
                    name = f"{entry.name}/{layout.name}"
                _TIMINGS.append((name, measured.wall_s, measured.timings()))
                self._done[key] = measured
            except BaseException as err:  # a hang or crash: every test of the group reports it
                self._done[key] = err
                if key in self._with_critic:
                    self._critic[key] = err
        result = self._done[key]
        if isinstance(result, BaseException):
            pytest.fail(
                f"the {entry.name}/{layout.name} group did not finish: {result}", pytrace=False
            )
        return result


@pytest.fixture(scope="session")
def contract_runs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> GroupRuns:
    return GroupRuns(tmp_path_factory, request)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _TIMINGS:
        return
    terminalreporter.section("contract suite: wall time per backend/layout group")
    for name, wall, sections in _TIMINGS:
        slow = sorted(sections.items(), key=lambda kv: -kv[1])[:4]
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in slow)
        terminalreporter.write_line(f"{name}: {wall:.1f}s (slowest sections: {parts})")
