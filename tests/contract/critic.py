"""The critic's contract (PPO with GAE): per backend and layout, against the independent fp32
reference of `tests.contract.critic_reference`.

Clauses (C for critic):

- C1 values of the batch at the initial weights (forward-only);
- C2 one RL step with GAE: every ``critic/`` metric the backend logs (value loss, clip
  fraction, gradient norm before clipping with the clip active, learning rate, explained
  variance, values / returns means, ...; a metric the reference lacks fails), each within its
  kind's tolerance (`clauses.metric_tolerance`: a fraction of tokens within one token) — over
  two critic optimizer steps on the whole batch (``epochs_per_rollout: 2``), the second clipped
  around the pre-step values;
- C3 the values after that step (the weights after two AdamW steps);
- C4 the same step with one sample per critic microbatch (``critic.micro_batch_size: 1``, run
  after restoring the initial checkpoint: this also checks that a checkpoint holds the critic)
  gives the same numbers; the data-parallel size: every layout matches the reference, and the
  suite compares each layout with the backend's first (every metric the step logs), and each
  backend's first layout with the first critic-capable backend's (C6);
- C5 the critic's Hugging Face export loads into ``AutoModelForTokenClassification`` with the
  backend's values.

The policy waits (``critic.warmup_steps: 1``): the critic's numbers do not depend on it.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from tests.contract import clauses, fixtures
from tests.contract.backends import BackendEntry, Layout
from tests.contract.clauses import Check, Measured, Tolerance, close, holds
from tests.contract.critic_reference import CriticReference, sequence_values
from tests.contract.harness import FORWARD_MICROBATCH, section
from tests.spawn import run_distributed

CRITIC_ALGORITHM = {
    "advantage_estimator": "gae",
    "gamma": 0.9,
    "lam": 0.8,
    # value_clip: per fixture init std (CRITIC_VALUE_CLIP_BY_INIT_STD)
    "value_coef": 0.5,
    "loss_aggregation": "token-mean",
}
CRITIC_OPTIMIZER = {
    "lr": 1e-2,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "eps": 1e-3,
    "lr_schedule": "constant",
}
# grad_clip per fixture init std, below both steps' reference gradient norms so that clipping is
# active (unclipped: 4.10 and 3.26 on the std-0.2 fixture; 0.58 and 0.60 on std 0.02, measured at
# value_clip 0.05)
CRITIC_GRAD_CLIP_BY_INIT_STD = {0.2: 0.3, 0.02: 0.2}
# value_clip per fixture init std: wide enough that after the first critic step most valid tokens
# move by less than the clip, so the second step's `critic/vf_clipfrac` counts a few tokens (moved
# past the clip, their clipped error the larger) and none of the rest (std 0.2: 1 of 56 at 3.0;
# std 0.02, whose values move less: 4 of 56 at 0.3, none at 0.5). A clip that flagged
# float-rounding ties inside the range (the old ``old + clamp(v - old)``) counted 3 to 8 of them
# on each backend, beyond the metric's one-token tolerance.
CRITIC_VALUE_CLIP_BY_INIT_STD = {0.2: 3.0, 0.02: 0.3}


def critic_config(base: Mapping[str, Any], *, micro_batch_size: int | None = None) -> dict:
    std = json.loads((Path(base["model"]["path"]) / "config.json").read_text())["initializer_range"]
    optimizer = {**CRITIC_OPTIMIZER, "grad_clip": CRITIC_GRAD_CLIP_BY_INIT_STD[std]}
    cfg = fixtures.merged(
        base,
        {
            "algorithm": {**CRITIC_ALGORITHM, "value_clip": CRITIC_VALUE_CLIP_BY_INIT_STD[std]},
            "batch": {"epochs_per_rollout": 2},
            "critic": {"optimizer": optimizer, "warmup_steps": 1},
            "train": {"rl_steps": 2},
        },
    )
    if micro_batch_size is not None:
        cfg["critic"]["micro_batch_size"] = micro_batch_size
    return cfg


# -- the group's job ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CriticJob:
    backend: str
    layout: Layout
    model_dir: str
    work_dir: str
    records: list[dict[str, Any]]
    dtype: str = "fp32"


def critic_values(backend: Any, records: list[dict[str, Any]]) -> dict[int, list[float]]:
    """Per-sample response values from `backend.critic.forward_values` over this rank's share."""
    from unirl.core.data.context_parallel import gather_from_cp
    from unirl.core.data.microbatch import build_microbatch
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.progress.bars import MicrobatchProgress

    topo = backend.topology
    batch = RolloutBatch.from_records(fixtures.select_fields(records, ()))
    mine = [i for i in range(len(batch)) if i % topo.dp_size == topo.dp_rank]
    chunks = [mine[j : j + FORWARD_MICROBATCH] for j in range(0, len(mine), FORWARD_MICROBATCH)]
    packs = [batch.pack(c) for c in chunks]
    mbs = [
        build_microbatch(p, cp_size=topo.cp_size, cp_rank=topo.cp_rank, cp_group=topo.groups.cp)
        for p in packs
    ]
    with MicrobatchProgress("contract values", len(mbs), topo, enabled=False) as bar:
        results = backend.critic.forward_values(mbs, progress=bar)
    out: dict[int, list[float]] = {}
    for pack, values in zip(packs, results):  # empty off the last pipeline stage
        values = values.detach().float()
        if topo.cp_size > 1:
            values = gather_from_cp(values, pack.cu_seqlens, topo.groups.cp)
        if topo.tp_rank != 0 or topo.cp_rank != 0:
            continue
        values = values.cpu()
        starts = pack.cu_seqlens.tolist()
        for k, sample in enumerate(pack.sample_indices):
            first = starts[k] + int(pack.prompt_lengths[k]) - 1
            out[sample] = values[first : first + int(pack.response_lengths[k])].tolist()
    return out


def run_critic_job(rank: int, world_size: int, job: CriticJob) -> dict[str, Any]:
    """Every critic clause's measurements on this rank (module docstring)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    os.environ["UNIRL_PROGRESS"] = "0"
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.protocols.backend_plugin import build_backend
    from unirl.core.step import RLStep

    work = Path(job.work_dir)
    base = fixtures.base_config(
        backend=job.backend,
        model_dir=job.model_dir,
        world_size=world_size,
        parallel=job.layout.parallel_dict,
        options=job.layout.options_dict,
        dtype=job.dtype,
        run_dir=str(work / "runs"),
    )
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"rank": rank, "errors": errors, "timings": timings}
    batch = RolloutBatch.from_records(fixtures.select_fields(job.records, ()))
    t0 = time.perf_counter()
    backend = None
    with section("build", errors, timings):
        cfg = config_from_dict(critic_config(base), world_size=world_size)
        backend = build_backend(cfg, total_optimizer_steps=2, needs_reference=False)
        topo = backend.topology
        out["topology"] = {
            "dp_size": topo.dp_size,
            "is_reporting_rank": topo.is_reporting_rank,
        }
    if backend is None:
        return out
    init = work / "ckpt-init"
    with section("values", errors, timings):
        out["values_init"] = critic_values(backend, job.records)
        backend.save_checkpoint(init, {"tag": "init"})
    for name, micro in (("step", None), ("step_micro1", 1)):
        with section(name, errors, timings):
            if micro is not None:
                backend.load_checkpoint(init)
            run_cfg = config_from_dict(
                critic_config(base, micro_batch_size=micro), world_size=world_size
            )
            metrics = RLStep(run_cfg, backend).run(batch, rl_step=0).metrics
            out[name] = {
                "metrics": dict(metrics),  # all of them: C4 / C6 compare every one
                "values": critic_values(backend, job.records),
            }
            if micro is None:
                export = work / "export-critic"
                backend.critic.export_hf(export)
                out["export"] = str(export)
    with section("close", errors, timings):
        backend.close()
    timings["total"] = time.perf_counter() - t0
    return out


CRITIC_GROUP_TIMEOUT_S = 480.0

# The layouts CI runs are those each plug-in marks ``critic`` (`tests.contract.backends.
# critic_layouts`), to keep its added time near a minute and a half; every other layout passed
# once by hand and runs in the GPU runners. Each is also a contract layout: when both suites run,
# one group of processes runs both jobs (`tests.contract.launch.contract_then`), so the critic
# adds no process start-up of its own.


def critic_job(
    entry: BackendEntry, layout: Layout, *, model_dir: Path, records: list[dict[str, Any]],
    work_dir: Path, dtype: str = "fp32",
) -> CriticJob:  # fmt: skip
    from tests.contract.launch import job_fields

    return CriticJob(
        **job_fields(
            entry, layout, model_dir=model_dir, records=records, work_dir=work_dir, dtype=dtype
        )
    )


def run_critic_group(
    entry: BackendEntry,
    layout: Layout,
    *,
    model_dir: Path,
    records: list[dict[str, Any]],
    work_dir: Path,
    device: str = "cpu",
    dtype: str = "fp32",
) -> Measured:
    job = critic_job(
        entry, layout, model_dir=model_dir, records=records, work_dir=work_dir, dtype=dtype
    )
    t0 = time.perf_counter()
    ranks = run_distributed(
        run_critic_job,
        layout.world_size,
        job,
        timeout=CRITIC_GROUP_TIMEOUT_S,
        backend="gloo" if device == "cpu" else "nccl",
    )
    return Measured(ranks, wall_s=time.perf_counter() - t0)


# -- the reference, once ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CriticReferenceResults:
    values_init: list[torch.Tensor]
    metrics: dict[str, float]
    values_after: list[torch.Tensor]
    clipped: list[bool]  # per critic step: the gradient was clipped
    value_clipped: list[int]  # per critic step: the valid tokens whose clipped value counted


def compute_critic_reference(
    model_dir: str | Path, records: list[dict[str, Any]]
) -> CriticReferenceResults:
    from tests.contract.reference import single_thread

    base = fixtures.base_config(
        backend="deepspeed",
        model_dir=str(model_dir),
        world_size=1,
        parallel={},
        dtype="fp32",
        run_dir="unused",
    )
    with single_thread():
        ref = CriticReference(model_dir, critic_config(base))
        values_init = ref.values(records)
        result = ref.rl_step(records)
        values_after = ref.values(records)
    return CriticReferenceResults(
        values_init=values_init,
        metrics=result["metrics"],
        values_after=values_after,
        clipped=[s["clipped"] for s in result["steps"]],
        value_clipped=[s["value_clipped"] for s in result["steps"]],
    )


# -- the clauses --------------------------------------------------------------------------------


def _merged(
    m: Measured, key: str, sub: str | None = None
) -> tuple[dict[int, list[float]], list[str]]:
    return clauses.merge_samples(r[key] if sub is None else r[key][sub] for r in m.ranks)


def _values_checks(
    clause: str,
    m: Measured,
    key: str,
    sub: str | None,
    expected: list[torch.Tensor],
    tol: Tolerance,
) -> list[Check]:
    merged, problems = _merged(m, key, sub)
    checks = [holds(clause, "every sample on exactly one rank", not problems, "; ".join(problems))]
    for i, exp in enumerate(expected):
        if i in merged:
            checks.append(close(clause, f"sample {i} values", merged[i], exp, tol))
    return checks


def clause_c1_values(m: Measured, ref: CriticReferenceResults, tol: Tolerance) -> list[Check]:
    m.need("values")
    return _values_checks("C1", m, "values_init", None, ref.values_init, tol)


def critic_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The critic's comparable metrics of a step (every ``critic/`` key but timings)."""
    return {k: v for k, v in clauses.comparable(metrics).items() if k.startswith("critic/")}


def clause_c2_step(m: Measured, ref: CriticReferenceResults, tol: Tolerance) -> list[Check]:
    """Every ``critic/`` metric the backend logs equals the reference's (the same keys: one the
    reference does not compute fails), each within its kind's tolerance."""
    m.need("step")
    got = m.reporting["step"]["metrics"]
    checks = [
        holds("C2", "the reference clips both steps", all(ref.clipped), f"{ref.clipped}"),
        holds(
            "C2",
            "the second step clips some valid tokens' values and not others",
            0 < ref.value_clipped[1] < fixtures.VALID_TOKENS,
            f"clipped tokens per step: {ref.value_clipped}",
        ),
    ]
    checks += clauses.close_metrics("C2", "metric", critic_metrics(got), ref.metrics, tol)
    return checks


def clause_c3_values_after(m: Measured, ref: CriticReferenceResults, tol: Tolerance) -> list[Check]:
    m.need("step")
    return _values_checks("C3", m, "step", "values", ref.values_after, tol)


def clause_c4_microbatching(m: Measured, tol: Tolerance) -> list[Check]:
    m.need("step", "step_micro1")
    a, b = m.reporting["step"], m.reporting["step_micro1"]
    checks = clauses.close_metrics(
        "C4",
        "critic.micro_batch_size 1 vs 3, metric",
        clauses.comparable(b["metrics"]),
        clauses.comparable(a["metrics"]),
        tol,
    )
    merged_a, _ = _merged(m, "step", "values")
    merged_b, problems = _merged(m, "step_micro1", "values")
    checks.append(holds("C4", "micro 1: every sample once", not problems, "; ".join(problems)))
    for i in sorted(set(merged_a) & set(merged_b)):
        checks.append(close("C4", f"micro 1 vs 3 sample {i} values", merged_b[i], merged_a[i], tol))
    return checks


def compare_critic_layouts(a: Measured, b: Measured, tol: Tolerance, label: str) -> list[Check]:
    a.need("step")
    b.need("step")
    checks = clauses.close_metrics(
        "C4",
        f"{label} metric",
        clauses.comparable(a.reporting["step"]["metrics"]),
        clauses.comparable(b.reporting["step"]["metrics"]),
        tol,
    )
    va, _ = _merged(a, "step", "values")
    vb, _ = _merged(b, "step", "values")
    for i in sorted(set(va) & set(vb)):
        checks.append(close("C4", f"{label} sample {i} values", va[i], vb[i], tol))
    return checks


def clause_c5_export(m: Measured, records: list[dict[str, Any]], tol: Tolerance) -> list[Check]:
    m.need("step")
    from transformers import AutoModelForTokenClassification

    path = m.ranks[0]["export"]
    model = AutoModelForTokenClassification.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    checks = [holds("C5", "one label", model.config.num_labels == 1, f"{model.config.num_labels}")]
    got, _ = _merged(m, "step", "values")
    with torch.no_grad():
        for i, rec in enumerate(records):
            if i in got:
                checks.append(
                    close(
                        "C5", f"export sample {i} values", sequence_values(model, rec), got[i], tol
                    )
                )
    return checks


def grouped(checks: list[Check]) -> dict[str, list[Check]]:
    """Checks by clause (what the GPU tables' ``summarise`` reads)."""
    out: dict[str, list[Check]] = {}
    for c in checks:
        out.setdefault(c.clause, []).append(c)
    return out


def all_critic_checks(
    m: Measured, ref: CriticReferenceResults, records: list[dict[str, Any]], tol: Tolerance
) -> list[Check]:
    """Every clause's checks of one group (the GPU tables); a failed section is one check."""
    checks: list[Check] = []
    for label, fn, args in (
        ("C1", clause_c1_values, (m, ref, tol)),
        ("C2", clause_c2_step, (m, ref, tol)),
        ("C3", clause_c3_values_after, (m, ref, tol)),
        ("C4", clause_c4_microbatching, (m, tol)),
        ("C5", clause_c5_export, (m, records, tol)),
    ):
        try:
            checks += fn(*args)
        except clauses.SectionFailed as err:
            checks.append(Check(label, "harness section", False, note=str(err)[-500:]))
    return checks
