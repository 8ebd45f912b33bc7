"""The backend contract: every backend x parallel layout computes the numbers of an independent
single-process fp32 reference (`tests/contract/reference.py`) on one fixture set.

Each (backend, layout) runs ONE group of processes that executes every clause
(`tests/contract/harness.py`); the tests below assert on its numbers, one test per clause (and per
variant where a clause has several), so a failure names the clause. Tolerances are in
`tests.contract.clauses.TOLERANCES` (fp32 on the CPU: 1e-5 relative and absolute).

    python -m pytest tests/contract -q                      # all layouts that run here
    python -m pytest tests/contract -q -k zero3-dp2         # one layout

Clauses: 1 forward-only log-probs; 2 loss and metrics per policy loss / KL estimator /
aggregation; 3 gradient norm and weights after one AdamW step; 4 independence of the microbatch
split and of the data-parallel size; 5 reuse == recompute and no forward-only pass with reuse;
6 one progress bar per phase on the reporting rank, one update per microbatch; 7 checkpoint at
step k + resume == uninterrupted; 8 the HF export loads into transformers with the same log-probs.

The MoE layouts (``moe-*``: the tiny Qwen3-MoE of `tests.contract.moe_fixture`) run the same
clauses on their own variants, with the router term in the loss (the reference computes it for
the microbatch split each group ran), and two more: the router's auxiliary losses (value and
gradient) and routing replay (``routing_replay: rollout`` against a transformers forward with
the routing forced to the rollout's experts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.contract import clauses, fixture_sets, multiturn
from tests.contract.backends import REGISTRY, SLOW_LAYOUTS, skip_reason

TOL = clauses.TOLERANCES["fp32"]


def _case(entry, layout) -> tuple[tuple, str, list]:
    """(the case's value, its id, its marks: a skip when its backend cannot run here, slow)."""
    reason = skip_reason(entry, layout, device="cpu", devices_available=0)
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    if layout.name in SLOW_LAYOUTS.get(entry.name, ()):
        marks.append(pytest.mark.slow)
    return (entry, layout), f"{entry.name}-{layout.name}", marks


def _cases(keep: Callable[[Any, Any], bool] = lambda entry, layout: True) -> list:
    """Every (backend, layout) for which ``keep`` holds: a clause that cannot apply to a layout
    is not generated for it (instead of a case that always skips)."""
    params = []
    for entry in REGISTRY.values():
        for layout in entry.layouts:
            if keep(entry, layout):
                value, case_id, marks = _case(entry, layout)
                params.append(pytest.param(value, id=case_id, marks=marks))
    return params


def for_cases(keep: Callable[[Any, Any], bool]) -> pytest.MarkDecorator:
    """The test runs on the cases ``keep`` selects (overrides the ``case`` fixture's params)."""
    return pytest.mark.parametrize("case", _cases(keep), scope="module")


def for_variants(
    names: Sequence[str], keep: Callable[[Any, Any], bool] = lambda entry, layout: True
) -> pytest.MarkDecorator:
    """The test runs on each (case, variant) whose layout's fixture has that variant, among the
    cases ``keep`` selects."""
    params = []
    for entry in REGISTRY.values():
        for layout in entry.layouts:
            if not keep(entry, layout):
                continue
            value, case_id, marks = _case(entry, layout)
            own = fixture_sets.variants(layout.fixture)
            params += [
                pytest.param(value, n, id=f"{case_id}-{n}", marks=marks) for n in names if n in own
            ]
    return pytest.mark.parametrize(("case", "variant"), params, scope="module")


@pytest.fixture(scope="module", params=_cases())
def case(request: pytest.FixtureRequest) -> tuple:
    return request.param


# Function-scoped on purpose: `case` is parametrized per test (`for_cases`, `for_variants`) over
# different lists, and a module-scoped fixture depending on it could be served from another
# list's case (a fused-head test measured a non-fused group). The runs themselves are cached per
# (backend, layout) in `contract_runs`; these are look-ups.
@pytest.fixture
def group(case: tuple, contract_runs) -> clauses.Measured:
    entry, layout = case
    return contract_runs.get(entry, layout)


@pytest.fixture
def layout_reference(
    case: tuple, group, request: pytest.FixtureRequest
) -> clauses.ReferenceResults:
    """The reference of the layout's fixture: the dense one (computed once), or the MoE one for
    the microbatch splits this group ran."""
    _, layout = case
    if layout.fixture == "moe":
        return request.getfixturevalue("moe_references").for_group(group)
    return request.getfixturevalue("contract_reference")


@pytest.fixture
def layout_records(case: tuple, request: pytest.FixtureRequest) -> list:
    _, layout = case
    return request.getfixturevalue(fixture_sets.DATA_FIXTURES[layout.fixture])[1]


def assert_checks(checks: Sequence[clauses.Check]) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        lines = [c.describe() for c in failed[:40]]
        more = f"\n... and {len(failed) - 40} more" if len(failed) > 40 else ""
        pytest.fail(
            f"{len(failed)} of {len(checks)} checks failed:\n" + "\n".join(lines) + more,
            pytrace=False,
        )


def _run(fn, *args) -> list[clauses.Check]:
    try:
        return fn(*args)
    except clauses.SectionFailed as err:
        pytest.fail(str(err), pytrace=False)


VARIANTS = fixture_sets.all_variant_names()
SPLITS = [
    n
    for n in VARIANTS
    for f in fixture_sets.FIXTURES
    if fixture_sets.variants(f).get(n, {}).get("same_as") == "ppo_dual_k1_token_mean"
]
SPLITS = list(dict.fromkeys(SPLITS))


def test_clause1_forward_logprobs(group, layout_reference):
    assert_checks(_run(clauses.clause1_forward, group, layout_reference, TOL))


@for_variants(VARIANTS)
def test_clause2_loss_and_metrics(group, layout_reference, variant):
    assert_checks(_run(clauses.clause2_metrics, group, layout_reference, variant, TOL))


@for_variants(VARIANTS)
def test_clause3_grad_norm_and_weights(group, layout_reference, variant):
    assert_checks(_run(clauses.clause3_update, group, layout_reference, variant, TOL))


@for_variants(SPLITS)
def test_clause4_microbatch_split(group, variant):
    assert_checks(_run(clauses.clause4_microbatching, group, variant, TOL))


def _baseline(entry, layout):
    """The backend's first layout of ``layout``'s fixture: the one its other layouts equal."""
    return next(x for x in entry.layouts if x.fixture == layout.fixture)


@for_cases(lambda entry, layout: layout != _baseline(entry, layout))
def test_clause4_data_parallel_size(case, group, contract_runs):
    """This layout gives the numbers of the backend's first layout (a different dp size or ZeRO
    stage), directly, on top of both matching the reference."""
    entry, layout = case
    baseline = _baseline(entry, layout)
    other = contract_runs.get(entry, baseline)
    label = f"{layout.name} vs {baseline.name}"
    assert_checks(_run(clauses.compare_layouts, group, other, TOL, label))


def test_clause5_reuse_equals_recompute(group):
    assert_checks(_run(clauses.clause5_reuse, group, TOL))


def test_clause6_progress_bars(group):
    assert_checks(_run(clauses.clause6_progress, group))


def test_clause7_checkpoint_resume(group, layout_reference):
    assert_checks(_run(clauses.clause7_resume, group, layout_reference, TOL))


def test_clause8_hf_export(group, layout_records):
    assert_checks(_run(clauses.clause8_export, group, layout_records, TOL))


def _is_moe(entry, layout) -> bool:
    return layout.fixture == "moe"


@for_cases(_is_moe)
def test_clause_router_losses(group, layout_reference):
    """MoE: the router's auxiliary and z-loss values and their gradient against the reference."""
    assert_checks(_run(clauses.clause_router, group, layout_reference, TOL))


@for_cases(_is_moe)
def test_clause_routing_replay(group, layout_reference):
    """MoE: replayed log-probs and one replayed step against a forced-routing transformers
    forward."""
    assert_checks(_run(clauses.clause_replay, group, layout_reference, TOL))


@for_cases(lambda entry, layout: multiturn.is_main_layout(entry.name, layout))
def test_multiturn_batch(group, request):
    """Observation tokens (mask 0, no rollout log-probs) inside responses and per-turn token
    rewards, on each backend's main layout: the loss, gradient norm and weights equal a per-turn
    Python loop's."""
    reference = request.getfixturevalue("contract_multiturn_reference")  # built only if it runs
    assert_checks(_run(multiturn.clause_multiturn, group, reference, TOL))


def test_logprob_path(case, group):
    """The log-probs came from the path the layout asks for: hidden states and the head's weight
    with ``model.fused_head``, logits otherwise (on the ranks that hold the loss; none other)."""
    entry, layout = case
    fused = bool(layout.model_dict.get("fused_head", False))
    calls = [r["logprob_calls"] for r in group.ranks]
    used, unused = (["hidden"], ["logits"]) if fused else (["logits"], ["hidden", "head_loss"])
    if fused:  # the loss inside the head where the backend declares it
        (used if entry.supports_loss_in_head else unused).append("head_loss")
    for key in unused:
        assert sum(c[key] for c in calls) == 0, (layout.name, key, calls)
    for key in used:
        assert sum(c[key] for c in calls) > 0, (layout.name, key, calls)


# GSPO's sequence ratio makes each token's gradient depend on its sequence's other tokens.
NOT_SEPARABLE = {"gspo_k2_seq_mean_token_mean"}


@for_variants(
    VARIANTS,
    lambda entry, layout: (
        layout.model_dict.get("fused_head", False) and entry.supports_loss_in_head
    ),
)
def test_head_loss_path(group, variant):
    """With ``model.fused_head``, on a backend that takes the loss into its fused head, the
    training forward of a loss that is a sum over tokens computes it inside the head
    (``head_loss``: 3 head matmuls); GSPO's takes the head's log-probs, then the loss (4
    matmuls)."""
    calls = [r["variants"][variant]["logprob_calls"] for r in group.ranks if "variants" in r]
    assert calls, group.ranks[0]["errors"]
    in_head = sum(c.get("head_loss", 0) for c in calls)
    if variant in NOT_SEPARABLE:
        assert in_head == 0 and sum(c.get("hidden", 0) for c in calls) > 0, (variant, calls)
    else:
        assert in_head > 0, (variant, calls)


def test_cpu_compat_lines_listed(group):
    """Megatron on the CPU: every megatron-core line that `cpu_compat` patched and that ran in this
    layout is one it lists (a patch reaching an unlisted CUDA line is an unreviewed change)."""
    reached = [r["cpu_compat_lines"] for r in group.ranks if "cpu_compat_lines" in r]
    if not reached:
        pytest.skip("this backend runs without unirl.backends.megatron.compat.cpu")
    from unirl.backends.megatron.compat import cpu as cpu_compat

    unlisted = sorted(set().union(*reached) - cpu_compat.listed_lines())
    assert not unlisted, f"patched megatron-core lines ran but are not listed: {unlisted}"
    assert reached[0], "cpu_compat was installed but patched nothing that ran"


@for_cases(lambda entry, layout: layout.parallel_dict.get("sequence_parallel", False))
def test_sequence_parallel_ran(group):
    """``parallel.sequence_parallel``: the activations between the TP matmuls were split along the
    sequence (megatron's reduce-scatter into the sequence slices ran; on the CPU the patched line
    of its output buffer records it)."""
    reached = [r.get("cpu_compat_lines", []) for r in group.ranks]
    assert all("tensor_parallel/mappings.py:181" in lines for lines in reached), reached
