"""Session fixtures of the contract suite: the tiny models on disk (dense and MoE, each built
only when a layout of it runs), the rollout records, the independent references (the dense one
computed once; the MoE one per microbatch split, `clauses.MoeReferences`), the LoRA contract's
start adapters and references, and one cached run per (backend, layout), with the critic's and
the LoRA contract's jobs of that layout in the same processes when their tests run too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.contract import clauses, critic, fixture_sets, launch, lora, multiturn
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


def _cases_collected(session: pytest.Session, test_file: str) -> set[tuple[str, str]]:
    """(backend, layout) of every case of ``test_file`` (in tests/contract) this session runs."""
    found = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if (
            item.path.name == test_file
            and callspec is not None
            and "case" in callspec.params
            and item.get_closest_marker("skip") is None
        ):
            entry, layout = callspec.params["case"]
            found.add((entry.name, layout.name))
    return found


@pytest.fixture(scope="session")
def lora_fixtures(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> lora.LoraFixtures:
    """The LoRA contract's per-fixture data, start adapter and reference."""
    return lora.LoraFixtures(
        lambda fixture: request.getfixturevalue(fixture_sets.DATA_FIXTURES[fixture]),
        tmp_path_factory.mktemp,
    )


class GroupRuns:
    """Runs each (backend, layout) group once per session and keeps its results (or error). A
    layout the session's critic or LoRA tests also run gets their jobs in the same processes
    (`launch.run_group_with`); `companion` hands their results to those tests."""

    def __init__(self, tmp: pytest.TempPathFactory, request: pytest.FixtureRequest) -> None:
        self._tmp = tmp
        self._request = request
        self._done: dict[tuple[str, str], clauses.Measured | BaseException] = {}
        self._companions: dict[str, dict[tuple[str, str], Any]] = {"critic": {}, "lora": {}}
        self._with = {
            "critic": _cases_collected(request.session, "test_critic.py"),
            "lora": _cases_collected(request.session, "test_lora.py"),
        }

    def companion(
        self, name: str, entry: BackendEntry, layout: Layout
    ) -> clauses.Measured | BaseException | None:
        """The ``name`` job's measurements of a layout run together with its contract group, or
        None (then its tests start a group of their own)."""
        return self._companions[name].get((entry.name, layout.name))

    def _companions_of(
        self, entry: BackendEntry, layout: Layout, model_dir: Path, records: list[dict[str, Any]]
    ) -> list[launch.Companion]:
        key = (entry.name, layout.name)
        tag = f"{entry.name}-{layout.name}"
        out = []
        if key in self._with["critic"] and layout.fixture == "dense":
            job = critic.critic_job(entry, layout, model_dir=model_dir, records=records,
                                    work_dir=self._tmp.mktemp(f"critic-{tag}"))  # fmt: skip
            out.append(
                launch.Companion(
                    "critic", critic.run_critic_job, job, critic.CRITIC_GROUP_TIMEOUT_S
                )
            )
        if key in self._with["lora"]:
            adapter = self._request.getfixturevalue("lora_fixtures").adapter(layout.fixture)
            job = lora.lora_job(entry, layout, model_dir=model_dir, adapter=adapter,
                                records=records, work_dir=self._tmp.mktemp(f"lora-{tag}"))  # fmt: skip
            out.append(launch.Companion("lora", lora.run_lora_job, job, lora.LORA_GROUP_TIMEOUT_S))
        return out

    def get(self, entry: BackendEntry, layout: Layout) -> clauses.Measured:
        key = (entry.name, layout.name)
        if key not in self._done:
            model_dir, records = self._request.getfixturevalue(
                fixture_sets.DATA_FIXTURES[layout.fixture]
            )
            work_dir = self._tmp.mktemp(f"{entry.name}-{layout.name}")
            name = f"{entry.name}/{layout.name}"
            companions: list[launch.Companion] = []
            try:
                companions = self._companions_of(entry, layout, model_dir, records)
                if companions:
                    measured, results = launch.run_group_with(
                        entry, layout, model_dir=model_dir, records=records, work_dir=work_dir,
                        companions=companions,
                    )  # fmt: skip
                    jobs = []
                    for companion, result in results.items():
                        self._companions[companion][key] = result
                        ok = isinstance(result, clauses.Measured)
                        total = result.timings().get("total", 0.0) if ok else float("nan")
                        jobs.append(f"{companion} {total:.1f}s")
                    name += f" (+ {', '.join(jobs)})"
                else:
                    measured = launch.run_group(
                        entry, layout, model_dir=model_dir, records=records, work_dir=work_dir
                    )
                _TIMINGS.append((name, measured.wall_s, measured.timings()))
                self._done[key] = measured
            except BaseException as err:  # a hang or crash: every test of the group reports it
                self._done[key] = err
                for companion in companions:
                    self._companions[companion.name][key] = err
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
