"""The router's load-balancing gradient where real checkpoints start (issue #44, item 15).

The MoE fixture (`tests.contract.moe_fixture`) draws its routers with std 0.5 so that routing is
confident; there the load-balancing term's gradient is small and a wrong one can hide. A model as
transformers initialises it (``initializer_range`` 0.02) routes near-uniformly, where the
balance term pulls hard. This job runs that regime on each backend's MoE layouts: the MoE
fixture's shape with ``initializer_range`` 0.02 and no router override, every reward 0 (GRPO
advantages 0: the policy term has no gradient), no KL and no entropy term, aux coefficient 0.5
and z-loss 0.001 (`COEFS`), one RL step. The step's gradient is the router term's alone: its
norm, every metric the backend logs and the updated weights must equal the fp32 transformers
reference (`tests.contract.reference.ReferenceRun`, the router term of
`tests.contract.moe_reference`) for the microbatch split the backend ran.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs
import torch

from tests.contract import clauses, fixtures, harness, moe_fixture, reference
from tests.contract.backends import BackendEntry, Layout
from tests.spawn import run_distributed

INIT_STD = 0.02  # transformers' default initializer_range, as real checkpoints start
COEFS = {"router_aux_loss_coef": 0.5, "router_z_loss_coef": 0.001}
VARIANT: dict[str, Any] = {
    "overrides": fixtures.merged(
        fixtures.VARIANTS["ppo_dual_k1_token_mean"]["overrides"],
        {"algorithm": {**COEFS, "entropy_coef": 0.0, "kl_loss": {"coef": 0.0}}},
    ),
    "data": ("rollout_logprobs",),
}
GROUP_TIMEOUT_S = 480.0


def write_model(path: Path) -> Path:
    """The MoE fixture's shape as transformers initialises it (no router override)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(fixtures.MODEL_SEED)
    config = Qwen3MoeConfig(**{**moe_fixture.TINY_QWEN3_MOE, "initializer_range": INIT_STD})
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return path


def prepare(root: Path) -> tuple[Path, list[dict[str, Any]]]:
    """(model folder, the fixture's records with every reward 0)."""
    model_dir = write_model(root / "tiny-qwen3-moe-init002")
    with reference.single_thread():
        model = reference.load_model(model_dir)
        stubs = [{"prompt_tokens": p, "response_tokens": r} for p, r in fixtures.token_ids()]
        true = reference.batch_logprobs(model, stubs, fixtures.TEMPERATURE)
    records = [{**r, "reward": 0.0} for r in fixtures.make_records(true)]
    return model_dir, records


@attrs.frozen(kw_only=True)
class RouterJob:
    backend: str
    layout: Layout
    model_dir: str
    work_dir: str
    records: list[dict[str, Any]]


def config(job_or_base: dict[str, Any]) -> dict[str, Any]:
    return fixtures.variant_config(fixtures.merged(job_or_base, {"algorithm": COEFS}), VARIANT)


def run_router_job(rank: int, world_size: int, job: RouterJob) -> dict[str, Any]:
    """One RL step on this rank: the metrics, the training split and the export."""
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.protocols.backend_plugin import build_backend
    from unirl.core.step import RLStep

    work = Path(job.work_dir)
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"rank": rank, "errors": errors, "timings": timings}
    with harness.section("build", errors, timings):
        base = fixtures.base_config(
            backend=job.backend,
            model_dir=job.model_dir,
            world_size=world_size,
            parallel=job.layout.parallel_dict,
            options=job.layout.options_dict,
            model=job.layout.model_dict,
            dtype="fp32",
            run_dir=str(work / "runs"),
        )
        cfg = config_from_dict(config(base), world_size=world_size)
        backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
        topo = backend.topology
        out["topology"] = {"dp_rank": topo.dp_rank, "is_reporting_rank": topo.is_reporting_rank}
    if "build" in errors:
        return out
    with harness.section("step", errors, timings):
        spy = harness.SplitSpy(backend)
        batch = RolloutBatch.from_records(fixtures.select_fields(job.records, VARIANT["data"]))
        out["metrics"] = dict(RLStep(cfg, backend).run(batch, rl_step=0).metrics)
        out["splits"] = spy.take()
        backend.export_hf(work / "export")
        out["export"] = str(work / "export")
        backend.close()
    return out


def run_group(
    entry: BackendEntry,
    layout: Layout,
    *,
    model_dir: Path,
    records: list[dict[str, Any]],
    work_dir: Path,
) -> clauses.Measured:
    job = RouterJob(
        backend=entry.name,
        layout=layout,
        model_dir=str(model_dir),
        work_dir=str(work_dir),
        records=records,
    )
    t0 = time.perf_counter()
    ranks = run_distributed(run_router_job, layout.world_size, job, timeout=GROUP_TIMEOUT_S)
    return clauses.Measured(ranks, wall_s=time.perf_counter() - t0)


def reference_step(
    model_dir: Path, records: list[dict[str, Any]], split: list[list[int]]
) -> dict[str, Any]:
    """The fp32 transformers step for ``split``: metrics and updated weights."""
    base = fixtures.base_config(
        backend="reference", model_dir=str(model_dir), world_size=1, parallel={},
        dtype="fp32", run_dir="",
    )  # fmt: skip
    with reference.single_thread():
        run = reference.ReferenceRun(reference.load_model(model_dir), config(base))
        result = run.step(fixtures.select_fields(records, VARIANT["data"]), split)
        return {**result, "weights": run.weights()}


def checks(m: clauses.Measured, ref: dict[str, Any], tol: clauses.Tolerance) -> list[clauses.Check]:
    """Every metric the backend logs (the gradient norm included) and every updated weight
    against the reference; and the regime is the one meant: the policy term is 0 and the
    router term moves the routers."""
    m.need("step")
    got = m.reporting
    out = [
        clauses.holds(
            "router-init",
            "the policy term is zero (every advantage 0)",
            ref["metrics"]["pg_loss"] == 0.0,
            f"pg_loss {ref['metrics']['pg_loss']}",
        ),
        clauses.holds(
            "router-init",
            "the router term's gradient is far above the tolerance",
            ref["metrics"]["grad_norm"] > 1e3 * tol.atol,
            f"grad_norm {ref['metrics']['grad_norm']}",
        ),
    ]
    out += clauses.close_metrics(
        "router-init",
        "metric",
        clauses.comparable(got["metrics"]),
        clauses.comparable(ref["metrics"]),
        tol,
    )
    out += clauses.close_dicts(
        "router-init", "weight", clauses.load_export(got["export"]), ref["weights"], tol
    )
    return out
