"""The LoRA contract (``model.lora``): per backend and layout, against the independent
transformers + peft fp32 reference of `tests.contract.lora_reference`.

Clauses (L for LoRA), on the contract's batch, from a random start adapter (B non-zero):

- L1 the policy's log-probs at the start adapter; the reference's log-probs are the plain base
  model's (the policy with its adapter off), counted as reference forwards, one per microbatch;
- L2 one RL step (PPO dual-clip, KL k1 to the reference model, entropy bonus, rollout log-probs
  as old): every metric the backend logs equals the reference's (the same keys), and the
  gradient norm before clipping (over the adapter only, clipping active); on Megatron also every
  adapter matrix's gradient before clipping (DDP's reduced ``main_grad``, `adapter_gradients`);
- L3 the adapter after the step (``adapter_state_dict``, PEFT names) equals the reference's
  adapter, and the merged weights (``hf_state_dict``) are the untouched base plus
  ``scale * B @ A`` of that adapter; on Megatron every rank's frozen parameters are bit for bit
  those before the step;
- L4 the same step with one sample per microbatch, after restoring the start checkpoint (a LoRA
  checkpoint: adapter and optimizer state), gives the same metrics and adapter; the suite
  compares each LoRA layout with its backend's first, and each backend's first with the first
  LoRA-capable backend's;
- L5 the exported adapter (``export_adapter``) loads with ``peft.PeftModel.from_pretrained``
  onto the base and gives the trainer's log-probs after the step.

Two fixtures (`ContractLayout.fixture`): the dense tiny Llama against peft
(`tests.contract.lora_reference`), and the tiny Qwen3-MoE with expert adapters (a layout marked
``lora`` on the ``moe`` fixture: Megatron's per-expert, per-projection form) against
`tests.contract.lora_moe_reference` (peft on the attention, a per-expert loop on the experts,
the router's z-loss in the step). On the MoE fixture L5's peft maps the per-expert export onto
transformers' fused experts itself (its v4-to-v5 conversion: rank 2r, B block-diagonal on
``gate_up_proj``), which the reference does not use.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from tests.contract import clauses, fixtures, lora_moe_reference, lora_reference, moe_reference
from tests.contract.backends import BackendEntry, Layout
from tests.contract.clauses import Check, Measured, Tolerance, close, holds
from tests.contract.harness import forward_only, section
from tests.contract.lora_reference import ALPHA, RANK, LoraReference, load_adapted, lora_section
from tests.contract.reference import batch_logprobs, single_thread
from tests.spawn import run_distributed

VARIANT = "ppo_dual_k1_token_mean"  # KL against the reference model (no ref_logprobs in data)
DATA = ("rollout_logprobs",)
# below the reference's adapter gradient norm (2.64 on the std-0.2 fixture) so clipping is active
LORA_GRAD_CLIP = 1.0
LORA_GROUP_TIMEOUT_S = 480.0
# Logged on the MoE fixture, not compared: the load-balancing statistic of each forward, which
# depends on the split and is not in this step's loss (coefficient 0, `lora_moe_reference`).
NOT_COMPARED = ("router/aux_loss",)


def lora_config(
    base: dict[str, Any], adapter: str, fixture: str, *, micro_batch_size: int | None = None
) -> dict[str, Any]:
    """The step's config on ``fixture``: the variant, the fixture's ``model.lora`` (on the MoE
    one with expert adapters and its router coefficients), the LoRA clip."""
    if fixture == "moe":
        extra = {
            "model": {"lora": lora_moe_reference.lora_section(adapter)},
            "algorithm": lora_moe_reference.ROUTER_COEFS,
        }
    else:
        extra = {"model": {"lora": lora_section(adapter)}}
    cfg = fixtures.merged(
        fixtures.variant_config(base, fixtures.VARIANTS[VARIANT]),
        fixtures.merged(extra, {"optimizer": {"grad_clip": LORA_GRAD_CLIP}}),
    )
    if micro_batch_size is not None:
        cfg["batch"]["micro_batch_size"] = micro_batch_size
    return cfg


@attrs.frozen(kw_only=True)
class LoraJob:
    backend: str
    layout: Layout
    model_dir: str
    work_dir: str
    adapter: str
    records: list[dict[str, Any]]


def adapter_gradients(backend: Any) -> dict[str, torch.Tensor]:
    """Megatron's adapter gradients after the step's backward, before clipping: DDP's
    ``main_grad`` (reduced over the data ranks when the schedule ends), gathered into PEFT names
    by the backend's own ``adapter_state_dict`` (each matrix's value swapped for its gradient,
    then restored; the gather itself is L3's). Collective."""
    params = list(backend.policy.adapters.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
    grads = backend.adapter_state_dict()
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)
    return grads


def frozen_parameters(backend: Any) -> dict[str, torch.Tensor]:
    """Megatron: every base parameter of this rank's chunks (all but the adapters' branches,
    ``<linear>_lora.lora_A`` / ``lora_B``, whether or not marked trainable), copied."""
    return {
        f"{i}.{name}": p.detach().clone()
        for i, chunk in enumerate(backend.model)
        for name, p in chunk.named_parameters()
        if "_lora.lora_" not in name
    }


def _step(
    backend: Any, cfg: dict, world_size: int, records: list, *, gradients: bool
) -> dict[str, Any]:
    """One RL step; ``gradients``: also the adapter's gradients, read just before the optimizer
    step (`adapter_gradients`; a backend that keeps them elsewhere is compared by its step)."""
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.step import RLStep

    run_cfg = config_from_dict(cfg, world_size=world_size)
    batch = RolloutBatch.from_records(fixtures.select_fields(records, DATA))
    before = dict(backend.forward_calls)
    seen: dict[str, Any] = {}
    optimizer_step = backend.optimizer_step

    def read_then_step() -> Any:
        seen["gradients"] = adapter_gradients(backend)
        return optimizer_step()

    if gradients:
        backend.optimizer_step = read_then_step
    try:
        metrics = RLStep(run_cfg, backend).run(batch, rl_step=0).metrics
    finally:
        backend.optimizer_step = optimizer_step
    calls = {k: v - before[k] for k, v in backend.forward_calls.items()}
    return {
        "metrics": dict(metrics),
        "calls": calls,
        "adapter": backend.adapter_state_dict(),
        "gradients": seen.get("gradients"),
    }


def run_lora_job(rank: int, world_size: int, job: LoraJob) -> dict[str, Any]:
    """Every LoRA clause's measurements on this rank (module docstring)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    os.environ["UNIRL_PROGRESS"] = "0"
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.protocols.backend_plugin import build_backend

    work = Path(job.work_dir)
    base = fixtures.base_config(
        backend=job.backend, model_dir=job.model_dir, world_size=world_size,
        parallel=job.layout.parallel_dict, options=job.layout.options_dict, dtype="fp32",
        run_dir=str(work / "runs"), model=job.layout.model_dict,
    )  # fmt: skip
    fixture = job.layout.fixture
    # Megatron's probes: `adapter_gradients` and `frozen_parameters` (where it keeps them)
    probes = job.backend == "megatron"
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    out: dict[str, Any] = {"rank": rank, "errors": errors, "timings": timings}
    t0 = time.perf_counter()
    backend = None
    with section("build", errors, timings):
        cfg = config_from_dict(lora_config(base, job.adapter, fixture), world_size=world_size)
        backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=True)
        topo = backend.topology
        out["topology"] = {"dp_size": topo.dp_size, "is_reporting_rank": topo.is_reporting_rank}
    if backend is None:
        return out
    init = work / "ckpt-init"
    with section("forward", errors, timings):
        out["policy"], _ = forward_only(backend, job.records, "policy")
        before = backend.forward_calls["reference"]
        out["reference"], n = forward_only(backend, job.records, "reference")
        out["reference_calls"] = (backend.forward_calls["reference"] - before, n)
        backend.save_checkpoint(init, {"tag": "init"})
    with section("step", errors, timings):
        cfg = lora_config(base, job.adapter, fixture)
        frozen = frozen_parameters(backend) if probes else None
        out["step"] = _step(backend, cfg, world_size, job.records, gradients=probes)
        if frozen is not None:  # bit for bit
            now = frozen_parameters(backend)
            out["base_changed"] = sorted(k for k, v in frozen.items() if not torch.equal(v, now[k]))
            out["base_count"] = len(frozen)
        merged = backend.hf_state_dict()  # collective
        out["merged"] = merged if topo.is_reporting_rank else None
        out["after"], _ = forward_only(backend, job.records, "policy")
        export = work / "adapter"
        backend.export_adapter(export)
        out["export"] = str(export)
    with section("step_micro1", errors, timings):
        backend.load_checkpoint(init)
        micro = lora_config(base, job.adapter, fixture, micro_batch_size=1)
        out["step_micro1"] = _step(backend, micro, world_size, job.records, gradients=probes)
    with section("close", errors, timings):
        backend.close()
    timings["total"] = time.perf_counter() - t0
    return out


def lora_job(
    entry: BackendEntry, layout: Layout, *, model_dir: Path, adapter: Path,
    records: list[dict[str, Any]], work_dir: Path,
) -> LoraJob:  # fmt: skip
    return LoraJob(
        backend=entry.name, layout=layout, model_dir=str(model_dir), work_dir=str(work_dir),
        adapter=str(adapter), records=records,
    )  # fmt: skip


def run_lora_group(
    entry: BackendEntry, layout: Layout, *, model_dir: Path, adapter: Path,
    records: list[dict[str, Any]], work_dir: Path,
) -> Measured:  # fmt: skip
    """The layout's LoRA job in a group of its own (when the contract's group did not run it:
    `tests.contract.launch.run_group_with`)."""
    job = lora_job(entry, layout, model_dir=model_dir, adapter=adapter, records=records,
                   work_dir=work_dir)  # fmt: skip
    t0 = time.perf_counter()
    ranks = run_distributed(run_lora_job, layout.world_size, job, timeout=LORA_GROUP_TIMEOUT_S)
    return Measured(ranks, wall_s=time.perf_counter() - t0)


# -- the fixtures and the reference, once per session ------------------------------------------

# Per fixture: its start adapter's writer.
START_ADAPTERS = {
    "dense": lora_reference.write_start_adapter,
    "moe": lora_moe_reference.write_start_adapter,
}


class LoraFixtures:
    """Per fixture, once per session and only when a case of it runs: the model and records
    (``data``: the fixture's session fixture, `fixture_sets.DATA_FIXTURES`), the start adapter
    and the reference's results."""

    def __init__(self, data: Callable[[str], Any], tmp: Callable[[str], Path]) -> None:
        self.data, self._tmp = data, tmp
        self._adapters: dict[str, Path] = {}
        self._references: dict[str, LoraReferenceResults] = {}

    def adapter(self, fixture: str) -> Path:
        if fixture not in self._adapters:
            out = self._tmp(f"lora-{fixture}") / "start"
            self._adapters[fixture] = START_ADAPTERS[fixture](self.data(fixture)[0], out)
        return self._adapters[fixture]

    def reference(self, fixture: str) -> LoraReferenceResults:
        if fixture not in self._references:
            model_dir, records = self.data(fixture)
            self._references[fixture] = compute_lora_reference(
                model_dir, self.adapter(fixture), records, fixture
            )
        return self._references[fixture]


@attrs.frozen(kw_only=True)
class LoraReferenceResults:
    policy: list[torch.Tensor]
    base: list[torch.Tensor]
    metrics: dict[str, float]
    clipped: bool
    adapter: dict[str, torch.Tensor]
    after: list[torch.Tensor]
    base_weights: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor]


def compute_lora_reference(
    model_dir: Path, adapter: Path, records: list[dict[str, Any]], fixture: str = "dense"
) -> LoraReferenceResults:
    """The reference's numbers of every clause for the fixture's model and start adapter."""
    base = fixtures.base_config(
        backend="deepspeed", model_dir=str(model_dir), world_size=1, parallel={}, dtype="fp32",
        run_dir="unused",
    )  # fmt: skip
    cls = lora_moe_reference.ExpertLoraReference if fixture == "moe" else LoraReference
    with single_thread():
        ref = cls(model_dir, adapter, lora_config(base, str(adapter), fixture))
        data = fixtures.select_fields(records, DATA)
        policy, base_lp = ref.logprobs(data), ref.base_logprobs(data)
        result = ref.step(data)
        weights = {k: v.detach().clone() for k, v in ref.base.state_dict().items()}
        return LoraReferenceResults(
            policy=policy,
            base=base_lp,
            metrics=result["metrics"],
            clipped=result["clipped"],
            adapter=ref.adapter(),
            after=ref.logprobs(data),
            # the experts per expert, as the exports name them
            base_weights=moe_reference.per_expert(weights) if fixture == "moe" else weights,
            gradients=ref.gradients,
        )


# -- the clauses --------------------------------------------------------------------------------


def _samples(clause: str, m: Measured, key: str, expected: list, tol: Tolerance) -> list[Check]:
    merged, problems = clauses.merge_samples(r[key] for r in m.ranks)
    checks = [holds(clause, f"{key}: every sample on one rank", not problems, "; ".join(problems))]
    for i, exp in enumerate(expected):
        if i in merged:
            checks.append(close(clause, f"{key} sample {i}", merged[i], exp, tol))
    return checks


def clause_l1_forward(m: Measured, ref: LoraReferenceResults, tol: Tolerance) -> list[Check]:
    m.need("forward")
    checks = _samples("L1", m, "policy", ref.policy, tol)
    checks += _samples("L1", m, "reference", ref.base, tol)
    for r in m.ranks:
        counted, microbatches = r["reference_calls"]
        checks.append(
            clauses.equal("L1", f"rank {r['rank']} reference forwards", counted, microbatches)
        )
    return checks


def clause_l2_step(m: Measured, ref: LoraReferenceResults, tol: Tolerance) -> list[Check]:
    m.need("step")
    got = m.reporting["step"]
    checks = [
        holds("L2", "the reference clips the adapter's gradient", ref.clipped, "raise the clip"),
        holds("L2", "the reference model ran", got["calls"]["reference"] > 0, f"{got['calls']}"),
        close("L2", "grad_norm", got["metrics"].get("grad_norm", float("nan")),
              ref.metrics["grad_norm"], tol),
    ]  # fmt: skip
    measured = clauses.comparable(got["metrics"], (*clauses.UPDATE_METRICS, *NOT_COMPARED))
    expected = clauses.comparable(ref.metrics, clauses.UPDATE_METRICS)
    checks += clauses.close_metrics("L2", "metric", measured, expected, tol)
    if got["gradients"] is not None:
        checks += clauses.close_dicts("L2", "gradient", got["gradients"], ref.gradients, tol)
    return checks


def clause_l3_adapter(m: Measured, ref: LoraReferenceResults, tol: Tolerance) -> list[Check]:
    m.need("step")
    got = m.reporting["step"]["adapter"]
    checks = clauses.close_dicts("L3", "adapter", got, ref.adapter, tol)
    for r in m.ranks:
        if "base_changed" in r:  # Megatron: every frozen parameter of the rank, bit for bit
            changed, count = r["base_changed"], r["base_count"]
            note = f"{len(changed)} of {count} changed, first {changed[:3]}"
            checks.append(
                holds("L3", f"rank {r['rank']} base unchanged", count and not changed, note)
            )
    merged = next(r["merged"] for r in m.ranks if r["merged"] is not None)
    scale = ALPHA / RANK
    expected = {}
    for name, w in ref.base_weights.items():
        a = got.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        b = got.get(f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight")
        expected[name] = w if a is None else w + scale * (b @ a)
    return checks + clauses.close_dicts("L3", "merged weight", merged, expected, tol)


def clause_l4_microbatching(m: Measured, tol: Tolerance) -> list[Check]:
    m.need("step", "step_micro1")
    return compare_steps(m.reporting["step_micro1"], m.reporting["step"], tol, "micro 1 vs 3")


def compare_steps(a: dict, b: dict, tol: Tolerance, label: str) -> list[Check]:
    checks = clauses.close_metrics(
        "L4",
        f"{label} metric",
        clauses.comparable(a["metrics"], NOT_COMPARED),
        clauses.comparable(b["metrics"], NOT_COMPARED),
        tol,
    )
    if a["gradients"] is not None and b["gradients"] is not None:
        checks += clauses.close_dicts(
            "L4", f"{label} gradient", a["gradients"], b["gradients"], tol
        )
    return checks + clauses.close_dicts("L4", f"{label} adapter", a["adapter"], b["adapter"], tol)


def compare_lora_layouts(a: Measured, b: Measured, tol: Tolerance, label: str) -> list[Check]:
    a.need("step")
    b.need("step")
    return compare_steps(a.reporting["step"], b.reporting["step"], tol, label)


def clause_l5_export(
    m: Measured, model_dir: Path, records: list[dict[str, Any]], tol: Tolerance
) -> list[Check]:
    m.need("step")
    from safetensors.torch import load_file

    export = Path(m.ranks[0]["export"])
    with single_thread():
        model = load_adapted(model_dir, export, trainable=False)
        reloaded = batch_logprobs(model, fixtures.select_fields(records, ()), fixtures.TEMPERATURE)
    names = sorted(load_file(str(export / "adapter_model.safetensors")))
    only = [n for n in names if ".lora_A." not in n and ".lora_B." not in n]
    checks = [holds("L5", "the export holds the adapter only", names and not only, f"{only[:3]}")]
    return checks + _samples("L5", m, "after", reloaded, tol)
