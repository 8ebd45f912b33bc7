"""What runs inside each process of one (backend, layout) group: every clause, measured once.

`run_job(rank, world_size, job)` builds the backend, runs all clauses in one go (process start and
engine init are the expensive part on a CPU runner) and returns plain numbers; the tests compare
them with the reference. Order:

1. forward-only log-probs of the policy and the reference model at the initial weights;
2. save the initial state (`save_checkpoint`); then for every variant: restore it
   (`load_checkpoint`), run one `RLStep`, record metrics, forward calls, progress bars, and export
   the updated weights (`export_hf`) for the weight comparison;
3. the resume run: n RL steps saving after step k, export; the policy's forward-only log-probs
   (for the export clause); then a fresh backend loads step k and runs to n, export;
4. the MoE fixture only: a backend built with ``routing_replay: rollout`` runs the forward-only
   pass and one RL step with the rollout's ``routed_experts`` (the routing-replay clause).

Every step records the sample indices of its training microbatches (`SplitSpy`): the MoE
reference's router term depends on the split.

A failing section records its traceback and the rest still runs (all ranks fail alike: the same
code on the same data), so one broken clause does not hide the others.
"""

from __future__ import annotations

import io
import os
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from tests.contract import fixture_sets, fixtures, moe_fixture, multiturn
from tests.contract.backends import Layout

if TYPE_CHECKING:
    from unirl.core.backend import InstrumentedBackend

FORWARD_MICROBATCH = 2  # samples per microbatch of the harness's own forward-only passes


@attrs.frozen(kw_only=True)
class Job:
    backend: str  # a registered backend name (`unirl.core.protocols.backend_plugin.BACKENDS`)
    layout: Layout
    model_dir: str
    work_dir: str  # shared by the ranks: checkpoints and exports
    records: list[dict[str, Any]]
    dtype: str = "fp32"
    fixture: str = "dense"  # `fixture_sets.FIXTURES`


# -- spies ----------------------------------------------------------------------------------


class BarSpy:
    """Records every tqdm bar `unirl.core.progress.bars` creates: phase, total, updates, closed."""

    def __init__(self) -> None:
        self.bars: list[dict[str, Any]] = []

    def install(self) -> None:
        from unirl.core.progress import bars as progress

        base = progress.tqdm
        spy = self

        class SpyTqdm(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                record = {
                    "desc": kwargs.get("desc"),
                    "total": kwargs.get("total"),
                    "update_calls": 0,
                    "updated": 0,
                    "closed": False,
                }
                spy.bars.append(record)
                self._contract_record = record
                kwargs["file"] = io.StringIO()  # keep the test output clean
                super().__init__(*args, **kwargs)

            def update(self, n: float | None = 1) -> bool | None:
                self._contract_record["update_calls"] += 1
                self._contract_record["updated"] += n
                return super().update(n)

            def close(self) -> None:
                self._contract_record["closed"] = True
                super().close()

        progress.tqdm = SpyTqdm

    def take(self) -> list[dict[str, Any]]:
        bars, self.bars = self.bars, []
        return [dict(b) for b in bars]


class ForwardCounter:
    """Counts calls of the backend's model module(s), split by whether autograd was on (a
    training forward) or off (a forward-only pass)."""

    def __init__(self, model: Any) -> None:
        self.train = 0
        self.no_grad = 0
        modules = model if isinstance(model, (list, tuple)) else [model]
        # Under virtual pipeline stages every chunk runs once per microbatch: count chunk 0.
        self._handle = modules[0].register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            self.train += 1
        else:
            self.no_grad += 1

    def take(self) -> dict[str, int]:
        out = {"train": self.train, "no_grad": self.no_grad}
        self.train = self.no_grad = 0
        return out

    def remove(self) -> None:
        self._handle.remove()


# -- helpers --------------------------------------------------------------------------------


class LogprobPathSpy:
    """Counts the calls of core's log-prob entry points as the backends reach them (through
    `unirl.core.backend`): from logits, from hidden states (``model.fused_head``), or the loss
    inside the fused head (``head_loss``: a separable loss with ``model.fused_head``)."""

    def __init__(self) -> None:
        self.calls = {"logits": 0, "hidden": 0, "head_loss": 0}

    def install(self) -> None:
        from unirl.core import backend as core_backend

        for key, name in (
            ("logits", "logprobs_from_logits"),
            ("hidden", "logprobs_from_hidden"),
            ("head_loss", "head_loss"),
        ):
            original = getattr(core_backend, name)

            def counted(*args: Any, _key: str = key, _fn: Any = original, **kwargs: Any) -> Any:
                self.calls[_key] += 1
                return _fn(*args, **kwargs)

            setattr(core_backend, name, counted)


def _calls(backend: InstrumentedBackend) -> dict[str, int]:
    return {k: int(v) for k, v in backend.forward_calls.items()}


def _delta(after: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


class SplitSpy:
    """Records the sample indices of every training microbatch `forward_backward` is handed on
    this rank: a mixture-of-experts step's router term depends on the split (the reference
    computes it for the split the backend ran)."""

    def __init__(self, backend: Any) -> None:
        self.splits: list[list[int]] = []
        original = backend.forward_backward

        def recorded(microbatches: Any, **kwargs: Any) -> Any:
            self.splits.extend([int(i) for i in mb.sample_indices] for mb in microbatches)
            return original(microbatches, **kwargs)

        backend.forward_backward = recorded

    def take(self) -> list[list[int]]:
        out, self.splits = self.splits, []
        return out


def forward_only(
    backend: Any,
    records: list[dict[str, Any]],
    role: str,
    data: tuple[str, ...] = (),
    *,
    routing: str = "off",
) -> tuple[dict[int, list[float]], int]:
    """Per-sample response log-probs from `backend.forward_logprobs` over this rank's share
    (samples ``i`` with ``i % dp == dp_rank``, in microbatches of `FORWARD_MICROBATCH`), and the
    number of microbatches; ``data``: the optional per-token fields the microbatches carry;
    ``routing``: the pass's routing replay (`LogprobSpec.routing`)."""
    from unirl.core.data.context_parallel import gather_from_cp
    from unirl.core.data.microbatch import build_microbatch
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress

    topo = backend.topology
    batch = RolloutBatch.from_records(fixtures.select_fields(records, data))
    mine = [i for i in range(len(batch)) if i % topo.dp_size == topo.dp_rank]
    chunks = [mine[j : j + FORWARD_MICROBATCH] for j in range(0, len(mine), FORWARD_MICROBATCH)]
    packs = [batch.pack(c) for c in chunks]
    mbs = [
        build_microbatch(p, cp_size=topo.cp_size, cp_rank=topo.cp_rank, cp_group=topo.groups.cp)
        for p in packs
    ]
    spec = LogprobSpec(
        temperature=fixtures.TEMPERATURE, vocab_size=backend.vocab_size, routing=routing
    )
    with MicrobatchProgress("contract forward", len(mbs), topo, enabled=False) as bar:
        results = backend.forward_logprobs(mbs, role=role, spec=spec, progress=bar)
    out: dict[int, list[float]] = {}
    for pack, logp in zip(packs, results):  # empty on ranks without the loss
        logp = logp.detach().float()
        if topo.cp_size > 1:
            logp = gather_from_cp(logp, pack.cu_seqlens, topo.groups.cp)  # collective
        if topo.tp_rank != 0 or topo.cp_rank != 0:
            continue  # TP and CP ranks then hold the same log-probs: count each sample once
        logp = logp.cpu()
        starts = pack.cu_seqlens.tolist()
        for k, sample in enumerate(pack.sample_indices):
            p = int(pack.prompt_lengths[k])
            r = int(pack.response_lengths[k])
            # response token j sits at start + p + j and is predicted by the logits before it
            first = starts[k] + p - 1
            out[sample] = logp[first : first + r].tolist()
    return out, len(mbs)


@contextmanager
def section(name: str, errors: dict[str, str], timings: dict[str, float]) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    except Exception:
        errors[name] = traceback.format_exc()
    finally:
        timings[name] = time.perf_counter() - t0


# -- the job --------------------------------------------------------------------------------


def run_job(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """Every clause's measurements on this rank (see the module docstring)."""
    os.environ["UNIRL_PROGRESS"] = "1"  # bars on, so the spy sees what a terminal would
    # DeepSpeed's ZeRO calls deprecated collectives once per step: keep the output readable.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return _GroupRun(rank, world_size, job).run()


class _GroupRun:
    def __init__(self, rank: int, world_size: int, job: Job) -> None:
        self.job = job
        self.world_size = world_size
        self.work = Path(job.work_dir)
        base = fixtures.base_config(
            backend=job.backend,
            model_dir=job.model_dir,
            world_size=world_size,
            parallel=job.layout.parallel_dict,
            options=job.layout.options_dict,
            model=job.layout.model_dict,
            dtype=job.dtype,
            run_dir=str(self.work / "runs"),
        )
        self.base = fixtures.merged(base, fixture_sets.base_overrides(job.fixture))
        self.errors: dict[str, str] = {}
        self.timings: dict[str, float] = {}
        self.out: dict[str, Any] = {
            "rank": rank,
            "errors": self.errors,
            "timings": self.timings,
            "fixture": job.fixture,
        }
        self.variant_table = fixture_sets.variants(job.fixture)
        self.spy = BarSpy()
        self.paths = LogprobPathSpy()
        self.init_ckpt = self.work / "ckpt-init"

    def section(self, name: str) -> Any:
        return section(name, self.errors, self.timings)

    def cfg_of(self, variant: Mapping[str, Any]) -> Any:
        from unirl.core.config.run_config import config_from_dict

        data = fixtures.variant_config(self.base, variant)
        return config_from_dict(data, world_size=self.world_size)

    def batch_of(
        self, variant: Mapping[str, Any], records: list[dict[str, Any]] | None = None
    ) -> Any:
        from unirl.core.data.rollout import RolloutBatch

        records = self.job.records if records is None else records
        return RolloutBatch.from_records(fixtures.select_fields(records, variant["data"]))

    def make_backend(self) -> Any:
        from unirl.core.protocols.backend_plugin import build_backend

        # The base config with the resume run's algorithm, which needs the reference model.
        return build_backend(
            self.cfg_of(fixtures.RESUME),
            total_optimizer_steps=fixtures.RESUME_STEPS + 1,
            needs_reference=True,
        )

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.spy.install()
        self.paths.install()
        backend = None
        with self.section("build"):
            backend = self.make_backend()
            topo = backend.topology
            self.out["topology"] = {
                "dp_size": topo.dp_size,
                "dp_rank": topo.dp_rank,
                "world_size": topo.world_size,
                "is_reporting_rank": topo.is_reporting_rank,
                "vocab_size": backend.vocab_size,
            }
        if backend is not None:
            from unirl.core.backend import InstrumentedBackend

            # the suite's probes are declared by the instrumented protocol, not reached for
            assert isinstance(backend, InstrumentedBackend), type(backend)
            self.counter = ForwardCounter(backend.model)
            self.split_spy = SplitSpy(backend)
            self.forward(backend)
            self.variants(backend)
            multiturn.measure(self, backend)  # the multi-turn batch (tests/contract/multiturn.py)
            self.resume(backend)
            if self.job.fixture == "moe":
                self.replay()
        self.timings["total"] = time.perf_counter() - t0
        self.out["logprob_calls"] = dict(self.paths.calls)
        compat = sys.modules.get("unirl.backends.megatron.compat.cpu")
        if compat is not None and compat.is_installed():  # patched lines of megatron-core that ran
            self.out["cpu_compat_lines"] = sorted(compat.reached_lines())
        return self.out

    def forward(self, backend: Any) -> None:
        """Clause 1: forward-only log-probs at the initial weights."""
        with self.section("forward"):
            self.spy.take()
            self.counter.take()
            before = _calls(backend)
            policy, microbatches = forward_only(backend, self.job.records, "policy")
            mid = _calls(backend)
            hooks_policy = self.counter.take()
            reference, _ = forward_only(backend, self.job.records, "reference")
            self.out["forward"] = {
                "policy": policy,
                "reference": reference,
                "forward_calls_policy": _delta(mid, before),
                "forward_calls_reference": _delta(_calls(backend), mid),
                "hook_policy": hooks_policy,
                "hook_reference": self.counter.take(),
                "microbatches": microbatches,
            }

    def variants(self, backend: Any) -> None:
        """Clauses 2-6: one RL step per variant, each from the initial state."""
        from unirl.core.step import RLStep

        with self.section("save_init"):
            backend.save_checkpoint(self.init_ckpt, {"tag": "init"})
        self.out["variants"] = {}
        for i, (name, variant) in enumerate(self.variant_table.items()):
            with self.section(f"variant:{name}"):
                record: dict[str, Any] = {}
                if i > 0:
                    record["client_state"] = dict(backend.load_checkpoint(self.init_ckpt) or {})
                cfg, batch = self.cfg_of(variant), self.batch_of(variant)
                self.spy.take()
                self.counter.take()
                self.split_spy.take()
                calls = _calls(backend)
                paths = dict(self.paths.calls)
                result = RLStep(cfg, backend).run(batch, rl_step=0)
                record.update(
                    splits=self.split_spy.take(),
                    metrics=dict(result.metrics),
                    logprob_calls=_delta(self.paths.calls, paths),
                    decision=result.decision.source,
                    hooks=self.counter.take(),
                    forward_calls=_delta(_calls(backend), calls),
                    bars=self.spy.take(),
                )
                export = self.work / "export" / name
                backend.export_hf(export)
                record["export"] = str(export)
                self.out["variants"][name] = record

    def resume(self, backend: Any) -> None:
        """Clause 7 (save after step k, resume in a fresh backend, run to n) and clause 8's
        measurements (the backend's own log-probs at the weights it exports)."""
        from unirl.core.step import RLStep

        cfg, batch = self.cfg_of(fixtures.RESUME), self.batch_of(fixtures.RESUME)
        k, n = fixtures.RESUME_SAVE_AFTER, fixtures.RESUME_STEPS
        step_ckpt = self.work / f"ckpt-step{k}"
        res: dict[str, Any] = {"uninterrupted": [], "bars": [], "hooks": [], "splits": []}
        self.out["resume"] = res
        with self.section("resume:uninterrupted"):
            backend.load_checkpoint(self.init_ckpt)
            step = RLStep(cfg, backend)
            for s in range(n):
                self.spy.take()
                self.counter.take()
                self.split_spy.take()
                res["uninterrupted"].append(dict(step.run(batch, rl_step=s).metrics))
                res["bars"].append(self.spy.take())
                res["hooks"].append(self.counter.take())
                res["splits"].append(self.split_spy.take())
                if s + 1 == k:
                    backend.save_checkpoint(step_ckpt, {"rl_step": k, "marker": "contract"})
            export = self.work / "export" / "resume-uninterrupted"
            backend.export_hf(export)
            res["export_uninterrupted"] = str(export)
        with self.section("export:logprobs"):
            self.out["export"] = {
                "path": res.get("export_uninterrupted"),
                "logprobs": forward_only(backend, self.job.records, "policy")[0],
            }
            # The reference model after training and checkpoint loads: still the initial one.
            res["reference_after"] = forward_only(backend, self.job.records, "reference")[0]
        with self.section("close"):
            self.counter.remove()
            backend.close()
        with self.section("resume:resumed"):
            fresh = self.make_backend()
            res["client_state"] = dict(fresh.load_checkpoint(step_ckpt) or {})
            step = RLStep(cfg, fresh)
            res["resumed"] = [dict(step.run(batch, rl_step=s).metrics) for s in range(k, n)]
            export = self.work / "export" / "resume-resumed"
            fresh.export_hf(export)
            res["export_resumed"] = str(export)
            fresh.close()

    def replay(self) -> None:
        """Routing replay (R3): a backend built with ``routing_replay: rollout`` at the initial
        weights; forward-only log-probs with the rollout's ``routed_experts`` replayed, then one
        RL step on them (metrics, the split, the updated weights)."""
        from unirl.core.protocols.backend_plugin import build_backend
        from unirl.core.step import RLStep

        variant = moe_fixture.REPLAY
        records = moe_fixture.with_routed_experts(self.job.records)
        res: dict[str, Any] = {}
        self.out["replay"] = res
        with self.section("replay"):
            cfg = self.cfg_of(variant)
            backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
            spy = SplitSpy(backend)
            res["forward"] = forward_only(
                backend, records, "policy", ("routed_experts",), routing="replay"
            )[0]
            spy.take()
            result = RLStep(cfg, backend).run(self.batch_of(variant, records), rl_step=0)
            res["metrics"] = dict(result.metrics)
            res["splits"] = spy.take()
            export = self.work / "export" / "replay"
            backend.export_hf(export)
            res["export"] = str(export)
            backend.close()
