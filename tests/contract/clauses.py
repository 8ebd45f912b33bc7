"""The contract's clauses as measurements: each turns one group's results and the reference into
`Check`s (the largest absolute and relative error and whether it is within tolerance).

The tests assert every check; `benchmarks/contract_table.py` writes the same checks as a table.
Tolerances are written once, here. A check's ``item`` names what was compared, so a failure reads
like "clause 2 / gspo_k2_seq_mean_token_mean / metric pg_clipfrac: got ..., expected ...".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.contract import fixture_sets, fixtures, moe_fixture, reference


@attrs.frozen
class Tolerance:
    rtol: float
    atol: float


# fp32 on the CPU: summation order (packing, microbatching, sharded reductions) is the only
# difference from the reference. bf16: reported by the GPU table, not asserted.
TOLERANCES = {"fp32": Tolerance(rtol=1e-5, atol=1e-5), "bf16": Tolerance(rtol=5e-2, atol=5e-2)}

# Metrics that measure time, not numbers.
UNCOMPARABLE_PREFIXES = ("time/", "throughput/")
# Metrics checked by clause 3 (gradient), not clause 2 (loss and metrics).
UPDATE_METRICS = ("grad_norm",)
# Counts and flags (samples, optimizer steps, skipped steps, the longest response, which old
# log-prob source or warm-up ran): integers in a float, so they agree exactly.
COUNT_METRICS = (
    "samples",
    "optimizer_steps",
    "skipped_steps",
    "response_length/max",
    "old_logprobs/recompute",
    "critic/skipped_steps",
    "critic/warmup",
)
# Fractions of the step's valid tokens (``*clipfrac``): each token is a yes / no decision at a
# boundary (a ratio at its clip bound, a value at ``old +- value_clip``), so a token within
# rounding of the boundary may fall on either side between summation orders. They agree within
# one token of the fixture's batch (`fixtures.VALID_TOKENS`; a mean over optimizer steps of such
# fractions moves by at most that), not within the value tolerance; more is a miscount.
TOKEN_FRACTION_SUFFIX = "clipfrac"


@attrs.frozen
class Check:
    clause: str
    item: str
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    note: str = ""

    def describe(self) -> str:
        errs = f"max abs err {self.max_abs:.3g}, max rel err {self.max_rel:.3g}"
        return f"[{self.clause}] {self.item}: {errs}" + (f" ({self.note})" if self.note else "")


class SectionFailed(Exception):
    """A harness section raised; the message is its traceback."""


def assert_checks(fn: Any, *args: Any) -> None:
    """Run a clause (``fn(*args)`` -> checks) and fail the test naming its failed checks (the
    first 40), or the harness section that raised."""
    try:
        checks = fn(*args)
    except SectionFailed as err:
        pytest.fail(str(err), pytrace=False)
    failed = [c for c in checks if not c.ok]
    if failed:
        pytest.fail(
            f"{len(failed)} of {len(checks)} checks failed:\n"
            + "\n".join(c.describe() for c in failed[:40]),
            pytrace=False,
        )


# -- comparisons ------------------------------------------------------------------------------


def _as_tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().reshape(-1)
    if isinstance(x, Mapping):
        raise TypeError("compare mappings key by key")
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], (list, tuple, torch.Tensor)):
        return torch.cat([_as_tensor(v) for v in x])
    return torch.tensor(x, dtype=torch.float64).reshape(-1)


def close(clause: str, item: str, got: Any, expected: Any, tol: Tolerance) -> Check:
    """``|got - expected| <= atol + rtol |expected|`` elementwise (torch.testing's rule); the
    check carries the largest absolute error and the largest ``|got - expected| / max(|expected|,
    atol)``."""
    g, e = _as_tensor(got), _as_tensor(expected)
    if g.shape != e.shape:
        return Check(
            clause, item, False, math.inf, math.inf, f"shape {tuple(g.shape)} != {tuple(e.shape)}"
        )
    if g.numel() == 0:
        return Check(clause, item, True)
    diff = (g - e).abs()
    finite = bool(torch.isfinite(g).all())
    rel = diff / e.abs().clamp(min=tol.atol)  # relative to max(|expected|, atol): 0 stays finite
    ok = finite and bool((diff <= tol.atol + tol.rtol * e.abs()).all())
    worst = int((diff - tol.rtol * e.abs()).argmax())
    note = ""
    if not ok:
        note = f"worst at index {worst}: got {g[worst].item():.9g}, expected {e[worst].item():.9g}"
        if not finite:
            note = "non-finite values; " + note
    return Check(clause, item, ok, float(diff.max()), float(rel.max()), note)


def equal(clause: str, item: str, got: Any, expected: Any) -> Check:
    ok = got == expected
    return Check(clause, item, ok, note="" if ok else f"got {got!r}, expected {expected!r}")


def holds(clause: str, item: str, condition: bool, note: str = "") -> Check:
    return Check(clause, item, bool(condition), note="" if condition else note)


def close_dicts(
    clause: str, item: str, got: Mapping[str, Any], expected: Mapping[str, Any], tol: Tolerance
) -> list[Check]:
    checks = [equal(clause, f"{item} keys", sorted(got), sorted(expected))]
    for key in sorted(set(got) & set(expected)):
        checks.append(close(clause, f"{item} {key}", got[key], expected[key], tol))
    return checks


def metric_tolerance(key: str, tol: Tolerance) -> Tolerance:
    """The tolerance of one metric by its kind: exact for a count, one token for a fraction of
    tokens, ``tol`` for every other value (module constants above)."""
    if key in COUNT_METRICS:
        return Tolerance(rtol=0.0, atol=1e-9)
    if key.endswith(TOKEN_FRACTION_SUFFIX):
        return Tolerance(rtol=0.0, atol=max(tol.atol, 1.0 / fixtures.VALID_TOKENS + 1e-9))
    return tol


def close_metrics(
    clause: str, item: str, got: Mapping[str, Any], expected: Mapping[str, Any], tol: Tolerance
) -> list[Check]:
    """Every metric of ``got`` against ``expected``: the same keys (a metric one side logs and
    the other does not fails), each value within its kind's tolerance (`metric_tolerance`)."""
    checks = [equal(clause, f"{item} keys", sorted(got), sorted(expected))]
    for key in sorted(set(got) & set(expected)):
        checks.append(
            close(clause, f"{item} {key}", got[key], expected[key], metric_tolerance(key, tol))
        )
    return checks


def comparable(metrics: Mapping[str, float], exclude: Sequence[str] = ()) -> dict[str, float]:
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith(UNCOMPARABLE_PREFIXES) and k not in exclude
    }


def load_export(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an HF export folder (every safetensors file in it)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SectionFailed(f"export folder {path} holds no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


# -- one group's results ----------------------------------------------------------------------


class Measured:
    """The per-rank results of one (backend, layout) group (see `harness.run_job`)."""

    def __init__(self, ranks: list[dict[str, Any]], wall_s: float = 0.0) -> None:
        self.ranks = ranks
        self.wall_s = wall_s
        self.errors: dict[str, str] = {}
        for r in ranks:
            for section, tb in r["errors"].items():
                self.errors.setdefault(section, f"rank {r['rank']}: {tb}")

    def need(self, *sections: str) -> None:
        for s in sections:
            if s in self.errors:
                raise SectionFailed(f"harness section {s!r} failed:\n{self.errors[s]}")
        if "build" in self.errors:
            raise SectionFailed(f"building the backend failed:\n{self.errors['build']}")

    @property
    def reporting(self) -> dict[str, Any]:
        return next(r for r in self.ranks if r["topology"]["is_reporting_rank"])

    @property
    def dp_size(self) -> int:
        return self.ranks[0]["topology"]["dp_size"]

    @property
    def fixture(self) -> str:
        return self.ranks[0].get("fixture", "dense")

    @property
    def variants(self) -> dict[str, dict[str, Any]]:
        """The variants this group ran (its fixture's)."""
        return fixture_sets.variants(self.fixture)

    def variant(self, name: str, rank: dict[str, Any] | None = None) -> dict[str, Any]:
        self.need(f"variant:{name}")
        return (rank or self.reporting)["variants"][name]

    def timings(self) -> dict[str, float]:
        """Per section, the slowest rank."""
        out: dict[str, float] = {}
        for r in self.ranks:
            for k, v in r["timings"].items():
                out[k] = max(out.get(k, 0.0), v)
        return out


def training_split(m: Measured, per_rank: Any) -> list[list[int]]:
    """Every rank's training microbatches of one step (sample indices), each data-parallel rank
    once (its TP / PP / CP / expert peers train on the same microbatches); ``per_rank``: a rank's
    results to its list of microbatches."""
    split: dict[int, list[list[int]]] = {}
    for r in m.ranks:
        split.setdefault(r["topology"]["dp_rank"], per_rank(r))
    return [mb for dp_rank in sorted(split) for mb in split[dp_rank]]


def merged_forward(
    m: Measured, key: str, role: str | None = None
) -> tuple[dict[int, list[float]], list[str]]:
    """Per-sample log-probs over all ranks, and the problems with coverage."""
    return merge_samples(r[key][role] if role else r[key]["logprobs"] for r in m.ranks)


def merge_samples(
    parts: Iterable[Mapping[int, list[float]]],
) -> tuple[dict[int, list[float]], list[str]]:
    """The ranks' per-sample values in one dict, and the problems with coverage: a sample that
    more than one rank returned, samples that none did."""
    merged: dict[int, list[float]] = {}
    problems = []
    for part in parts:
        for sample, values in part.items():
            if sample in merged:
                problems.append(f"sample {sample} returned by more than one rank")
            merged[sample] = values
    missing = sorted(set(range(fixtures.NUM_SAMPLES)) - set(merged))
    if missing:
        problems.append(f"samples {missing} returned by no rank")
    return merged, problems


# -- the reference, computed once -------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReferenceResults:
    logprobs: list[torch.Tensor]  # initial policy, per sample
    variants: dict[str, dict[str, Any]]  # name -> {"metrics", "weights", "clipped"}
    resume: dict[str, Any]  # {"metrics": [per step], "weights": final}
    # MoE: routing replay {"logprobs": forced forward, "free_logprobs", "metrics", "weights"}
    replay: dict[str, Any] | None = None


def compute_reference(model_dir: str | Path, records: list[dict[str, Any]]) -> ReferenceResults:
    with reference.single_thread():
        return _compute_reference(model_dir, records)


def _reference_base(model_dir: str | Path) -> dict[str, Any]:
    return fixtures.base_config(
        backend="reference",
        model_dir=str(model_dir),
        world_size=1,
        parallel={},
        dtype="fp32",
        run_dir="",
    )


def _compute_reference(model_dir: str | Path, records: list[dict[str, Any]]) -> ReferenceResults:
    base = _reference_base(model_dir)
    model = reference.load_model(model_dir)
    logprobs = reference.batch_logprobs(model, records, fixtures.TEMPERATURE)
    variants: dict[str, dict[str, Any]] = {}
    for name, variant in fixtures.VARIANTS.items():
        if "same_as" in variant:
            continue  # the reference does not split batches: the same step as its base
        cfg = fixtures.variant_config(base, variant)
        run = reference.ReferenceRun(model, cfg)
        result = run.step(fixtures.select_fields(records, variant["data"]))
        variants[name] = {**result, "weights": run.weights()}
    for name, variant in fixtures.VARIANTS.items():
        if "same_as" in variant:
            same = variants[variant["same_as"]]
            metrics = dict(same["metrics"])
            metrics["old_logprobs/recompute"] = float(
                variant["overrides"].get("old_logprobs") == "recompute"
            )
            variants[name] = {**same, "metrics": metrics}
    cfg = fixtures.variant_config(base, fixtures.RESUME)
    run = reference.ReferenceRun(model, cfg)
    data = fixtures.select_fields(records, fixtures.RESUME["data"])
    steps = [run.step(data)["metrics"] for _ in range(fixtures.RESUME_STEPS)]
    return ReferenceResults(
        logprobs=logprobs, variants=variants, resume={"metrics": steps, "weights": run.weights()}
    )


class MoeReferences:
    """The MoE fixture's reference for one group: its router term depends on the microbatch
    split, so each step is computed for the split the group ran (`training_split`), and cached
    by (step, split) across groups."""

    def __init__(self, model_dir: str | Path, records: list[dict[str, Any]]) -> None:
        self.model_dir = model_dir
        self.records = records
        self._cache: dict[Any, Any] = {}
        with reference.single_thread():
            self.model = reference.load_model(model_dir)
            self.logprobs = reference.batch_logprobs(self.model, records, fixtures.TEMPERATURE)

    def _base(self) -> dict[str, Any]:
        return fixtures.merged(_reference_base(self.model_dir), moe_fixture.BASE)

    def _cached(self, key: Any, compute: Any) -> Any:
        if key not in self._cache:
            with reference.single_thread():
                self._cache[key] = compute()
        return self._cache[key]

    def _variant(self, name: str, split: list[list[int]]) -> dict[str, Any]:
        variant = moe_fixture.VARIANTS[name]
        cfg = fixtures.variant_config(self._base(), variant)
        run = reference.ReferenceRun(self.model, cfg)
        result = run.step(fixtures.select_fields(self.records, variant["data"]), split)
        metrics = dict(result["metrics"])
        metrics["old_logprobs/recompute"] = float(
            variant["overrides"].get("old_logprobs") == "recompute"
        )
        return {**result, "metrics": metrics, "weights": run.weights()}

    def _resume(self, splits: list[list[list[int]]]) -> dict[str, Any]:
        cfg = fixtures.variant_config(self._base(), fixtures.RESUME)
        run = reference.ReferenceRun(self.model, cfg)
        data = fixtures.select_fields(self.records, fixtures.RESUME["data"])
        steps = [run.step(data, split)["metrics"] for split in splits]
        return {"metrics": steps, "weights": run.weights()}

    def _replay(self, split: list[list[int]]) -> dict[str, Any]:
        variant = moe_fixture.REPLAY
        records = moe_fixture.with_routed_experts(self.records)
        forced = {
            tuple(r["prompt_tokens"] + r["response_tokens"]): r["routed_experts"] for r in records
        }
        cfg = fixtures.variant_config(self._base(), variant)
        run = reference.ReferenceRun(self.model, cfg, forced=forced)
        logprobs = reference.batch_logprobs(run.model, records, fixtures.TEMPERATURE)
        result = run.step(fixtures.select_fields(records, variant["data"]), split)
        return {**result, "logprobs": logprobs, "weights": run.weights()}

    def for_group(self, m: Measured) -> ReferenceResults:
        def key(split: list[list[int]]) -> tuple:
            return tuple(tuple(mb) for mb in split)

        variants = {}
        for name in moe_fixture.VARIANTS:
            m.need(f"variant:{name}")
            split = training_split(m, lambda r, n=name: r["variants"][n]["splits"])
            variants[name] = self._cached(
                ("variant", name, key(split)), functools.partial(self._variant, name, split)
            )
        resume: dict[str, Any] = {}
        if "resume:uninterrupted" not in m.errors:
            splits = [
                training_split(m, lambda r, s=s: r["resume"]["splits"][s])
                for s in range(fixtures.RESUME_STEPS)
            ]
            resume = self._cached(
                ("resume", tuple(key(x) for x in splits)), lambda: self._resume(splits)
            )
        replay = None
        if "replay" not in m.errors and "build" not in m.errors:
            split = training_split(m, lambda r: r["replay"]["splits"])
            replay = self._cached(("replay", key(split)), lambda: self._replay(split))
            replay = {**replay, "free_logprobs": self.logprobs}
        return ReferenceResults(
            logprobs=self.logprobs, variants=variants, resume=resume, replay=replay
        )


# -- the clauses ------------------------------------------------------------------------------


def clause1_forward(m: Measured, ref: ReferenceResults, tol: Tolerance) -> list[Check]:
    """Forward-only per-token log-probs of the policy and of the reference model equal the
    reference's, at the initial weights; the pass runs without autograd, once per microbatch."""
    m.need("forward")
    checks = []
    expected = [ref.logprobs[i] for i in range(fixtures.NUM_SAMPLES)]
    for role in ("policy", "reference"):
        got, problems = merged_forward(m, "forward", role)
        checks.append(holds("1", f"{role}: every sample once", not problems, "; ".join(problems)))
        if not problems:
            values = [torch.tensor(got[i]) for i in range(fixtures.NUM_SAMPLES)]
            checks.append(close("1", f"{role} log-probs", values, expected, tol))
    for r in m.ranks:
        f, rank = r["forward"], f"rank {r['rank']}"
        want = {"train": 0, "no_grad": f["microbatches"]}
        checks.append(
            equal("1", f"{rank}: policy model calls (autograd off)", f["hook_policy"], want)
        )
        checks.append(
            equal(
                "1",
                f"{rank}: reference pass does not run the policy",
                f["hook_reference"],
                {"train": 0, "no_grad": 0},
            )
        )
        for role, other in (("policy", "reference"), ("reference", "policy")):
            # backend.forward_calls counts every model forward of a role, one per microbatch
            delta = f[f"forward_calls_{role}"]
            got = {role: delta.get(role, 0), other: delta.get(other, 0)}
            want = {role: f["microbatches"], other: 0}
            checks.append(
                equal("1", f"{rank}: backend.forward_calls during the {role} pass", got, want)
            )
    return checks


def expected_decision(variant: Mapping[str, Any]) -> str:
    """One optimizer step per rollout and no feature reading pre-step log-probs: auto reuses."""
    mode = variant["overrides"].get("old_logprobs", "auto")
    return "reuse" if mode == "auto" else mode


def clause2_metrics(m: Measured, ref: ReferenceResults, name: str, tol: Tolerance) -> list[Check]:
    """The loss and every metric of one step equal the reference; every rank reports the same."""
    got = m.variant(name)
    expected = comparable(ref.variants[name]["metrics"], UPDATE_METRICS)
    measured = comparable(got["metrics"], UPDATE_METRICS)
    checks = [
        equal(
            "2",
            f"{name}: old log-prob source",
            got["decision"],
            expected_decision(m.variants[name]),
        )
    ]
    checks += close_metrics("2", f"{name}: metric", measured, expected, tol)
    for r in m.ranks:
        other = comparable(m.variant(name, r)["metrics"])
        mine = comparable(got["metrics"])
        differ = sorted(k for k in set(other) | set(mine) if other.get(k) != mine.get(k))
        checks.append(
            holds(
                "2",
                f"{name}: rank {r['rank']} reports the reporting rank's metrics",
                not differ,
                f"differing: {differ}",
            )
        )
    return checks


def clause3_update(m: Measured, ref: ReferenceResults, name: str, tol: Tolerance) -> list[Check]:
    """The gradient norm (before clipping) and the weights after one AdamW step with clipping
    equal the reference's."""
    got = m.variant(name)
    expected = ref.variants[name]
    checks = [
        holds(
            "3",
            f"{name}: the fixture clips the gradient",
            expected["clipped"],
            "reference gradient norm is below grad_clip: the clause would not test clipping",
        ),
        close(
            "3",
            f"{name}: grad_norm",
            got["metrics"].get("grad_norm", math.nan),
            expected["metrics"]["grad_norm"],
            tol,
        ),
    ]
    weights = load_export(got["export"])
    checks += close_dicts("3", f"{name}: weight", weights, expected["weights"], tol)
    return checks


# What an MoE step's router term makes depend on the microbatch split (its balance statistic is
# per forward, `unirl.core.maths.losses.router`): compared with the reference computed for each
# split (clauses 2-3), not between splits.
SPLIT_DEPENDENT = ("router/aux_loss", "router/z_loss", "grad_norm")


def _split_free(m: Measured, metrics: Mapping[str, float]) -> dict[str, float]:
    return comparable(metrics, SPLIT_DEPENDENT if m.fixture == "moe" else ())


def clause4_microbatching(m: Measured, name: str, tol: Tolerance) -> list[Check]:
    """The same step split into other microbatches gives the same metrics, gradient norm and
    weights as the base split (each is also compared with the reference by clauses 2-3). For
    the MoE fixture: the metrics that do not depend on the split (`SPLIT_DEPENDENT`)."""
    base_name = m.variants[name]["same_as"]
    got, base = m.variant(name), m.variant(base_name)
    checks = [
        holds(
            "4",
            f"{name}: the split differs from {base_name}'s",
            got["hooks"]["train"] != base["hooks"]["train"],
            f"both ran {got['hooks']['train']} training forwards: nothing was varied",
        ),
    ]
    checks += close_metrics(
        "4",
        f"{name} vs {base_name}: metric",
        _split_free(m, got["metrics"]),
        _split_free(m, base["metrics"]),
        tol,
    )
    if m.fixture == "moe":
        return checks
    checks += close_dicts(
        "4",
        f"{name} vs {base_name}: weight",
        load_export(got["export"]),
        load_export(base["export"]),
        tol,
    )
    return checks


def compare_layouts(a: Measured, b: Measured, tol: Tolerance, label: str) -> list[Check]:
    """Two layouts of one backend give the same numbers for every variant (clause 4, dp size)."""
    checks = []
    for name in a.variants:
        ga, gb = a.variant(name), b.variant(name)
        checks += close_metrics(
            "4",
            f"{label} {name}: metric",
            _split_free(a, ga["metrics"]),
            _split_free(a, gb["metrics"]),
            tol,
        )
        if a.fixture == "moe":
            continue  # the weights: against the reference of each split (clause 3)
        checks.append(
            close(
                "4",
                f"{label} {name}: weights",
                list(load_export(ga["export"]).values()),
                list(load_export(gb["export"]).values()),
                tol,
            )
        )
    return checks


def clause5_reuse(m: Measured, tol: Tolerance) -> list[Check]:
    """reuse == recompute on the same weights (loss, metrics, gradient norm, weights); recompute's
    ratio is 1; reuse runs no forward-only pass."""
    reuse, recompute = m.variant("reuse"), m.variant("recompute")
    checks = [
        equal("5", "reuse: decision", reuse["decision"], "reuse"),
        equal("5", "recompute: decision", recompute["decision"], "recompute"),
    ]
    exclude = ("old_logprobs/recompute",)
    checks += close_metrics(
        "5",
        "reuse vs recompute: metric",
        comparable(reuse["metrics"], exclude),
        comparable(recompute["metrics"], exclude),
        tol,
    )
    checks += close_dicts(
        "5",
        "reuse vs recompute: weight",
        load_export(reuse["export"]),
        load_export(recompute["export"]),
        tol,
    )
    # ratio exp(logp - old) == 1 on every token: the forward-only pass equals the training one
    checks.append(
        close(
            "5",
            "recompute: ppo_kl (ratio 1)",
            recompute["metrics"].get("ppo_kl", math.nan),
            0.0,
            tol,
        )
    )
    checks.append(
        close(
            "5",
            "recompute: pg_clipfrac (ratio 1)",
            recompute["metrics"].get("pg_clipfrac", math.nan),
            0.0,
            tol,
        )
    )
    for r in m.ranks:
        ru, rc = m.variant("reuse", r), m.variant("recompute", r)
        rank = f"rank {r['rank']}"
        checks.append(
            equal("5", f"{rank} reuse: policy forwards without autograd", ru["hooks"]["no_grad"], 0)
        )
        # backend.forward_calls counts every policy forward, training ones included
        checks.append(
            equal(
                "5",
                f"{rank} reuse: backend.forward_calls['policy'] = training microbatches",
                ru["forward_calls"].get("policy", 0),
                ru["hooks"]["train"],
            )
        )
        checks.append(
            holds(
                "5",
                f"{rank} recompute: one forward-only pass per training microbatch",
                rc["hooks"]["no_grad"] == rc["hooks"]["train"] > 0,
                f"hooks {rc['hooks']}",
            )
        )
        checks.append(
            equal(
                "5",
                f"{rank} recompute: backend.forward_calls['policy'] = 2 x training microbatches",
                rc["forward_calls"].get("policy", 0),
                2 * rc["hooks"]["train"],
            )
        )
    return checks


def expected_phases(overrides: Mapping[str, Any], data: Sequence[str], decision: str) -> list[str]:
    kl = overrides.get("algorithm", {}).get("kl_loss", {}).get("coef", 0.0)
    phases = ["actor train"]
    if decision == "recompute":
        phases.append("actor forward")
    if kl > 0 and "ref_logprobs" not in data:
        phases.append("ref forward")
    return sorted(phases)


def _bars_checks(
    label: str,
    m: Measured,
    per_rank: list[tuple[dict, list[dict], int]],
    phases: list[str],
    hand_count: int | None,
) -> list[Check]:
    checks = []
    for r, bars, train_mbs in per_rank:
        rank = f"{label} rank {r['rank']}"
        if not r["topology"]["is_reporting_rank"]:
            checks.append(equal("6", f"{rank} (not reporting): bars drawn", len(bars), 0))
            continue
        checks.append(
            equal("6", f"{rank}: one bar per phase", sorted(b["desc"] for b in bars), phases)
        )
        if hand_count is not None:
            checks.append(equal("6", f"{rank}: training microbatches", train_mbs, hand_count))
        for b in bars:
            got = {k: b[k] for k in ("total", "update_calls", "updated", "closed")}
            want = {
                "total": train_mbs,
                "update_calls": train_mbs,
                "updated": train_mbs,
                "closed": True,
            }
            checks.append(equal("6", f"{rank} bar {b['desc']!r}", got, want))
    return checks


def clause6_progress(m: Measured) -> list[Check]:
    """Exactly one bar per phase, on the reporting rank only, advanced once per microbatch."""
    checks = []
    for name, variant in m.variants.items():
        rep = m.variant(name)
        phases = expected_phases(variant["overrides"], variant["data"], rep["decision"])
        # count mode: 12 samples over dp ranks in microbatches of micro_batch_size
        mbs = fixtures.micro_batch_size(variant)
        by_hand = None if mbs is None else fixtures.NUM_SAMPLES // (m.dp_size * mbs)
        per_rank = [
            (r, m.variant(name, r)["bars"], m.variant(name, r)["hooks"]["train"]) for r in m.ranks
        ]
        checks += _bars_checks(name, m, per_rank, phases, by_hand)
    m.need("resume:uninterrupted")
    for step in range(fixtures.RESUME_STEPS):
        per_rank = [
            (r, r["resume"]["bars"][step], r["resume"]["hooks"][step]["train"]) for r in m.ranks
        ]
        phases = expected_phases(fixtures.RESUME["overrides"], fixtures.RESUME["data"], "reuse")
        by_hand = fixtures.NUM_SAMPLES // (m.dp_size * fixtures.micro_batch_size(fixtures.RESUME))
        checks += _bars_checks(f"resume step {step}", m, per_rank, phases, by_hand)
    return checks


def clause7_resume(m: Measured, ref: ReferenceResults, tol: Tolerance) -> list[Check]:
    """Save after step k, resume in a fresh backend, run to n: the same losses and weights as the
    uninterrupted run; and the uninterrupted run follows the reference step by step."""
    m.need("resume:uninterrupted", "resume:resumed")
    res = m.reporting["resume"]
    k, n = fixtures.RESUME_SAVE_AFTER, fixtures.RESUME_STEPS
    checks = [
        equal(
            "7",
            "client_state returned by load_checkpoint",
            {key: res["client_state"].get(key) for key in ("rl_step", "marker")},
            {"rl_step": k, "marker": "contract"},
        )
    ]
    for name in list(m.variants)[1:]:  # each variant restored the initial checkpoint
        state = m.variant(name).get("client_state", {})
        checks.append(
            equal("7", f"{name}: client_state of the initial checkpoint", state.get("tag"), "init")
        )
    m.need("export:logprobs")
    after, problems = merged_forward(m, "resume", "reference_after")
    checks.append(
        holds(
            "7",
            "reference model after training: every sample once",
            not problems,
            "; ".join(problems),
        )
    )
    if not problems:
        values = [torch.tensor(after[i]) for i in range(fixtures.NUM_SAMPLES)]
        checks.append(
            close(
                "7",
                "reference model after training and loads: initial log-probs",
                values,
                ref.logprobs,
                tol,
            )
        )
    for s in range(k, n):
        checks += close_metrics(
            "7",
            f"step {s + 1} resumed vs uninterrupted: metric",
            comparable(res["resumed"][s - k]),
            comparable(res["uninterrupted"][s]),
            tol,
        )
    checks += close_dicts(
        "7",
        "resumed vs uninterrupted: final weight",
        load_export(res["export_resumed"]),
        load_export(res["export_uninterrupted"]),
        tol,
    )
    for s in range(n):
        checks += close_metrics(
            "7",
            f"step {s + 1} uninterrupted vs reference: metric",
            comparable(res["uninterrupted"][s]),
            comparable(ref.resume["metrics"][s]),
            tol,
        )
    checks += close_dicts(
        "7",
        "uninterrupted vs reference: final weight",
        load_export(res["export_uninterrupted"]),
        ref.resume["weights"],
        tol,
    )
    return checks


def clause8_export(m: Measured, records: list[dict[str, Any]], tol: Tolerance) -> list[Check]:
    """The HF export loads into transformers and gives the backend's own log-probs."""
    m.need("resume:uninterrupted", "export:logprobs")
    path = m.reporting["export"]["path"]
    with reference.single_thread():
        model = reference.load_model(path, attn_implementation=None)  # as a user would load it
        expected = reference.batch_logprobs(model, records, fixtures.TEMPERATURE)
    got, problems = merged_forward(m, "export")
    checks = [holds("8", "every sample once", not problems, "; ".join(problems))]
    if not problems:
        values = [torch.tensor(got[i]) for i in range(fixtures.NUM_SAMPLES)]
        checks.append(
            close("8", "backend log-probs vs transformers on the export", values, expected, tol)
        )
    return checks


def all_checks(
    m: Measured, ref: ReferenceResults, records: list[dict[str, Any]], tol: Tolerance
) -> dict[str, list[Check]]:
    """Every clause of one group; a clause whose harness section failed yields one failed check."""
    out: dict[str, list[Check]] = {}

    def run(key: str, fn: Any, *args: Any) -> None:
        try:
            out[key] = fn(*args)
        except SectionFailed as err:
            out[key] = [
                Check(key.split(":")[0], key, False, math.inf, math.inf, str(err).splitlines()[-1])
            ]

    run("1", clause1_forward, m, ref, tol)
    for name in m.variants:
        run(f"2:{name}", clause2_metrics, m, ref, name, tol)
        run(f"3:{name}", clause3_update, m, ref, name, tol)
        if "same_as" in m.variants[name] and name != "recompute":
            run(f"4:{name}", clause4_microbatching, m, name, tol)
    run("5", clause5_reuse, m, tol)
    run("6", clause6_progress, m)
    run("7", clause7_resume, m, ref, tol)
    run("8", clause8_export, m, records, tol)
    if m.fixture == "moe":
        run("router", clause_router, m, ref, tol)
        run("replay", clause_replay, m, ref, tol)
    return out


# -- mixture of experts -------------------------------------------------------------------------


ROUTER_METRICS = ("router/aux_loss", "router/z_loss")


def _is_router_weight(name: str) -> bool:
    return name.endswith(".mlp.gate.weight")


def clause_router(m: Measured, ref: ReferenceResults, tol: Tolerance) -> list[Check]:
    """The router's auxiliary losses: ``router/aux_loss`` and ``router/z_loss`` of every variant
    equal the reference's (each for the split the group ran), and so do the gradient norm and the
    routers' weights after each variant's step (`moe_fixture.ROUTER_COEFS`: the router term is
    a visible part of the gradient)."""
    coefs = moe_fixture.ROUTER_COEFS
    checks = [
        holds(
            "router",
            "the fixture's aux and z-loss coefficients are on",
            coefs["router_aux_loss_coef"] > 0 and coefs["router_z_loss_coef"] > 0,
            f"{coefs}",
        )
    ]
    for name in m.variants:
        got, want = m.variant(name), ref.variants[name]
        for key in ROUTER_METRICS:
            value = got["metrics"].get(key, math.nan)
            checks.append(close("router", f"{name}: {key}", value, want["metrics"][key], tol))
        checks.append(
            close(
                "router",
                f"{name}: grad_norm",
                got["metrics"].get("grad_norm", math.nan),
                want["metrics"]["grad_norm"],
                tol,
            )
        )
        weights = load_export(got["export"])
        routers = sorted(k for k in want["weights"] if _is_router_weight(k))
        checks.append(holds("router", f"{name}: router weights", bool(routers), "none found"))
        for key in routers:
            checks.append(
                close(
                    "router",
                    f"{name}: updated {key}",
                    weights.get(key, torch.full((1,), math.nan)),
                    want["weights"][key],
                    tol,
                )
            )
    return checks


def clause_replay(m: Measured, ref: ReferenceResults, tol: Tolerance) -> list[Check]:
    """Routing replay (``routing_replay: rollout``): the forward-only log-probs with the rollout's
    ``routed_experts`` equal a transformers forward with the routing forced to them; one RL step
    on them gives the forced reference's loss, metrics (``router/disagreement`` included),
    gradient norm and updated weights; and the forcing matters (the free log-probs differ)."""
    m.need("replay")
    assert ref.replay is not None
    checks = []
    got, problems = merged_forward(m, "replay", "forward")
    checks.append(holds("replay", "forward: every sample once", not problems, "; ".join(problems)))
    if not problems:
        values = [torch.tensor(got[i]) for i in range(fixtures.NUM_SAMPLES)]
        checks.append(
            close("replay", "forward log-probs (forced)", values, ref.replay["logprobs"], tol)
        )
        moved = max(
            float((a - b).abs().max())
            for a, b in zip(ref.replay["logprobs"], ref.replay["free_logprobs"])
        )
        checks.append(
            holds(
                "replay",
                "forcing changes the log-probs",
                moved > 1e3 * tol.atol,
                f"only {moved:.3g}",
            )
        )
    metrics = m.reporting["replay"]["metrics"]
    checks += close_metrics(
        "replay", "step: metric", comparable(metrics), comparable(ref.replay["metrics"]), tol
    )
    checks.append(
        holds(
            "replay", "step: the fixture clips the gradient", ref.replay["clipped"], "not clipped"
        )
    )
    checks += close_dicts(
        "replay",
        "step: weight",
        load_export(m.reporting["replay"]["export"]),
        ref.replay["weights"],
        tol,
    )
    return checks
