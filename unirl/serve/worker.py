"""The one thread that runs queued requests, in arrival order per training client.

Each round takes everything queued; per training client, consecutive ``forward_backward`` (or
``forward``) requests with the same loss are run as ONE backend call whose datums are packed
into the backend's microbatches (`unirl.serve.batching`), not one forward per request. Clients
are independent (separate backends), so their requests may run in any order relative to each
other; one client's requests keep their order.

Under torchrun (`unirl.serve.ranks`) rank 0's worker thread runs the queue and hands every unit
that touches a backend to the other ranks, which run it in their main thread (`follow`); the
outcomes the ranks agree on complete the futures on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from unirl.core.maths.logprob_spec import LogprobSpec
from unirl.core.progress.bars import MicrobatchProgress
from unirl.serve import state
from unirl.serve.batching import pack, split_per_datum
from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest
from unirl.serve.futures import FutureStore, Outcome
from unirl.serve.jobs import CreateJob, FwdBwdJob, Job, LoadJob, OptimJob, SampleWork, SaveJob
from unirl.serve.losses import SummedLoss
from unirl.serve.ranks import JobRelay
from unirl.serve.sampling import SamplerPool
from unirl.serve.sessions import Sessions, TrainingSession, build_training_backend
from unirl.serve.stability import StabilityRecords
from unirl.serve.vllm_engine import saved_fingerprint
from unirl.serve.vllm_sampling import VllmSampling
from unirl.serve.wire import encode_forward_backward_output

logger = logging.getLogger(__name__)


def build_sampling(cfg: ServeConfig) -> SamplerPool | VllmSampling:
    """What runs ``sample`` / ``compute_logprobs`` (``serve.sampling``; vLLM itself is imported
    when its first engine starts)."""
    if cfg.sampling == "vllm":
        return VllmSampling(cfg)
    return SamplerPool(cfg.train_model_dtype())


def batch_rounds(jobs: Sequence[Job]) -> list[list[Job]]:
    """The drained jobs as units of work: a list of several `FwdBwdJob` of one client and key
    runs as one backend call; every other job alone. Per client the order is kept."""
    units: list[list[Job]] = []
    last_unit: dict[str, list[Job]] = {}
    for job in jobs:
        model = getattr(job, "model_id", None)
        prev = last_unit.get(model) if model is not None else None
        if (
            isinstance(job, FwdBwdJob)
            and prev is not None
            and isinstance(prev[-1], FwdBwdJob)
            and prev[-1].batch_key == job.batch_key
        ):  # joins the client's last unit: other clients' units in between are independent
            prev.append(job)
            continue
        unit: list[Job] = [job]
        units.append(unit)
        if model is not None:
            last_unit[model] = unit
    return units


class Worker:
    def __init__(
        self,
        cfg: ServeConfig,
        futures: FutureStore,
        sessions: Sessions,
        relay: JobRelay | None = None,
    ) -> None:
        """``relay``: the other ranks under torchrun (None: one process)."""
        self.cfg, self.futures, self.sessions, self.relay = cfg, futures, sessions, relay
        self.samplers = build_sampling(cfg)
        # what sampling recorded for stable_reinforce (this rank serves: rank 0)
        self.stability = StabilityRecords()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="unirl-serve-worker", daemon=True)
        # Backend calls made (forward_backward / forward_logprobs): how well requests batch.
        self.backend_calls = 0

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _drain(self) -> tuple[list[Job], bool]:
        first = self._queue.get()
        jobs: list[Job] = [] if first is None else [first]
        stop = first is None
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return jobs, stop
            if job is None:
                stop = True
            else:
                jobs.append(job)

    def _loop(self) -> None:
        stop = False
        while not stop:
            jobs, stop = self._drain()
            for unit in batch_rounds(jobs):
                self._serve_unit(unit)
        if self.relay is not None:
            self.relay.send(None)

    def follow(self) -> None:
        """A rank other than 0: run rank 0's units until the server stops."""
        assert self.relay is not None and not self.relay.serving
        while (unit := self.relay.receive()) is not None:
            self._agree(unit, self._outcomes(unit))

    def _serve_unit(self, unit: list[Job]) -> None:
        """Rank 0: run the unit (with the other ranks when it touches a backend), complete its
        futures."""
        everywhere = self.relay is not None and not isinstance(unit[0], SampleWork)
        if everywhere:
            assert self.relay is not None
            try:
                self.relay.send(unit)
            except Exception as exc:
                outcome = Outcome(error=f"{type(exc).__name__}: {exc}", category="server")
                for job in unit:
                    self.futures.complete(job.request_id, outcome)
                return
        mine = self._outcomes(unit)
        outcomes = mine if isinstance(unit[0], SampleWork) else self._agree(unit, mine)
        assert outcomes is not None
        for job, outcome in zip(unit, outcomes, strict=True):
            self.futures.complete(job.request_id, outcome)

    def _agree(self, unit: list[Job], mine: list[Outcome] | None) -> list[Outcome]:
        """The outcomes every rank takes (one process: its own); a server error inside a
        client's forward_backward or optim_step stops that client on every rank."""
        outcomes = self.relay.agree(mine) if self.relay is not None else mine
        assert outcomes is not None
        job = unit[0]
        failed = outcomes[0].error is not None and outcomes[0].category == "server"
        if failed and isinstance(job, (FwdBwdJob, OptimJob)):
            self.sessions.mark_failed(
                job.model_id, f"request {job.request_id}: {outcomes[0].error}"
            )
        return outcomes

    def _outcomes(self, unit: list[Job]) -> list[Outcome] | None:
        """This rank's outcomes of the unit; None where it has no results (a pipeline stage
        before the last after a forward)."""
        try:
            with torch.no_grad() if isinstance(unit[0], SampleWork) else contextlib.nullcontext():
                return self._run(unit)
        except BadRequest as exc:
            return [Outcome(error=str(exc), category="user")] * len(unit)
        except Exception as exc:
            logger.exception("request %s failed", unit[0].request_id)
            return [Outcome(error=f"{type(exc).__name__}: {exc}", category="server")] * len(unit)

    def _run(self, unit: list[Job]) -> list[Outcome] | None:
        job = unit[0]
        if isinstance(job, FwdBwdJob):
            return self._forward_backward(unit)  # type: ignore[arg-type]
        if isinstance(job, SampleWork):
            proto = self.samplers.run(job.job)
            if job.record_stability:
                self.stability.record(job.request_id, job.job.prompt, proto)
            return [Outcome(proto=proto)]
        if isinstance(job, CreateJob):
            backend = build_training_backend(self.cfg, job.weights, job.lora)
            self.sessions.add(TrainingSession(job.model_id, job.base_model, backend, job.lora))
            return [Outcome(json={"model_id": job.model_id, "type": "create_model"})]
        if isinstance(job, OptimJob):
            return [self._optim_step(job)]
        if isinstance(job, SaveJob):
            return [self._save(job)]
        assert isinstance(job, LoadJob)
        return [self._load(job)]

    def _forward_backward(self, jobs: Sequence[FwdBwdJob]) -> list[Outcome] | None:
        session = self.sessions.get(jobs[0].model_id)
        backend = session.backend
        datums = [d for job in jobs for d in job.datums]
        mbs = pack(datums, self.cfg.tokens_per_microbatch)
        loss_fn = SummedLoss(settings=jobs[0].settings)
        # the model's vocabulary: megatron pads its embedding rows, which are no tokens
        spec = LogprobSpec(vocab_size=backend.vocab_size)
        progress = MicrobatchProgress("serve", len(mbs), backend.topology, enabled=False)
        self.backend_calls += 1
        with progress:
            if jobs[0].forward_only:
                logps = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=progress)
                for mb, lp in zip(mbs, logps, strict=False):  # [] off the last pipeline stage
                    lp = lp.detach().cpu()  # beside the microbatch's tensors (on a GPU: not)
                    loss_fn.records.append((lp, loss_fn.per_token(mb, lp)))
            else:
                backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=progress)
        if len(loss_fn.records) != len(mbs):  # a pipeline stage before the last: rank 0 of
            return None  # the torchrun ranks takes the last stage's outcomes (`JobRelay.agree`)
        # to the host once per microbatch (not per datum)
        logprobs = split_per_datum(mbs, [r[0].detach().float().cpu() for r in loss_fn.records])
        losses = split_per_datum(mbs, [r[1].detach().cpu() for r in loss_fn.records])
        outcomes, start = [], 0
        for job in jobs:
            end = start + len(job.datums)
            outputs = [{"logprobs": lp.numpy()} for lp in logprobs[start:end]]
            total = float(sum(float(x.sum()) for x in losses[start:end]))
            proto = encode_forward_backward_output(outputs, {"loss:sum": total})
            outcomes.append(Outcome(proto=proto))
            start = end
        return outcomes

    def _optim_step(self, job: OptimJob) -> Outcome:
        session = self.sessions.get(job.model_id)
        session.backend.set_step_settings(job.settings)  # type: ignore[attr-defined]
        stats = session.backend.optimizer_step()
        session.optimizer_steps += 1
        metrics = {"grad_norm:mean": stats.grad_norm, "learning_rate:mean": stats.lr}
        return Outcome(json={"metrics": metrics})

    def _save(self, job: SaveJob) -> Outcome:
        session = self.sessions.get(job.model_id)
        meta = {
            "base_model": session.base_model,
            "optimizer_steps": session.optimizer_steps,
            "lora": dict(session.lora),
            "save_id": uuid.uuid4().hex,  # each save's own: what samplers know it by
        }
        rank = 0 if self.relay is None else self.relay.rank
        barrier = self.relay.barrier if self.relay is not None else None
        with state.PartialWrite(job.path.folder(self.cfg.state_dir), rank, barrier) as tmp:
            if job.path.kind == "weights":
                session.backend.save_checkpoint(tmp / state.CHECKPOINT, meta)
                session.backend.export_adapter(tmp / state.ADAPTER)  # type: ignore[attr-defined]
            else:
                self._save_for_sampler(session, tmp, meta)
            if rank == 0:
                (tmp / state.META).write_text(json.dumps(meta))
        kind = "save_weights" if job.path.kind == "weights" else "save_weights_for_sampler"
        body = {"path": job.path.uri, "type": kind}
        if job.sampling_session_id is not None:
            body["sampling_session_id"] = job.sampling_session_id
        return Outcome(json=body)

    def _save_for_sampler(self, session: TrainingSession, tmp: Path, meta: dict[str, Any]) -> None:
        """The built-in sampler loads the merged weights W + scale * B @ A; vLLM the adapter,
        checked against its fingerprint as this client holds it, kept in ``meta``
        (`unirl.serve.vllm_engine`)."""
        if self.cfg.sampling != "vllm":
            session.backend.export_hf(tmp / state.HF)
            return
        session.backend.export_adapter(tmp / state.ADAPTER)  # type: ignore[attr-defined]
        adapter = session.backend.adapter_state_dict()  # type: ignore[attr-defined]
        dtype = self.cfg.engine_dtype()
        meta["adapter_fingerprint"] = saved_fingerprint(adapter, session.lora, dtype)
        meta["adapter_dtype"] = dtype

    def _load(self, job: LoadJob) -> Outcome:
        """Weights only: a new backend whose adapter starts from the saved PEFT folder; with the
        optimizer: a new backend with the saved adapter shape, then its checkpoint."""
        meta = state.read_meta(job.folder)
        old = None if job.base_model is not None else self.sessions.get(job.model_id)
        base_model = job.base_model if old is None else old.base_model
        if meta["base_model"] != base_model:
            raise BadRequest(
                "path", f"holds a state of {meta['base_model']!r}, not of {base_model!r}"
            )
        lora = dict(meta["lora"])
        if not job.optimizer:
            lora["path"] = str(job.folder / state.ADAPTER)
        backend = build_training_backend(self.cfg, self.cfg.base_model_folder(base_model), lora)
        steps = 0
        if job.optimizer:
            backend.load_checkpoint(job.folder / state.CHECKPOINT)
            steps = int(meta["optimizer_steps"])
        if old is not None:
            old.backend.close()
        self.sessions.add(TrainingSession(job.model_id, base_model, backend, lora, steps))
        body = {"path": job.path.uri, "model_id": job.model_id, "type": "load_weights"}
        return Outcome(json=body)
