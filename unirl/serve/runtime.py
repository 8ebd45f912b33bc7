"""What the routes share: the config, the futures, the training clients, the sampling
sessions and the worker that runs the queue."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import attrs

from unirl.backends.process_group import (
    ProcessGroupSetup,
    destroy_process_group,
    init_process_group,
)
from unirl.core.config.sections.training import ParallelConfig
from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest
from unirl.serve.futures import FutureStore
from unirl.serve.jobs import Job
from unirl.serve.ranks import JobRelay
from unirl.serve.sampling import SampleSeeds
from unirl.serve.sessions import Sessions
from unirl.serve.worker import Worker


@attrs.frozen(kw_only=True)
class SamplingSession:
    base_model: str
    model_path: str | None  # tinker:// sampler weights; None: the base model
    weights: Path  # the Hugging Face folder sampled from


class Runtime:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.futures = FutureStore()
        self.sessions = Sessions()
        self.worker = Worker(cfg, self.futures, self.sessions)
        self.serving = True  # rank 0 (or one process): runs the HTTP server and the queue
        self.sampling: dict[str, SamplingSession] = {}
        self.seeds = SampleSeeds(cfg.sample_seed)
        self._names = itertools.count(1)
        self._lock = threading.Lock()
        self._group: ProcessGroupSetup | None = None

    def start(self) -> None:
        """Rank 0 starts the worker thread; under torchrun the other ranks then `follow`."""
        # One process group for every client's backend (world size 1, or torchrun's ranks): a
        # backend that finds it does not own it, so closing one client never tears it down
        # under another.
        self._group = init_process_group(ParallelConfig())
        if self._group.world_size > 1:
            self.worker.relay = JobRelay()
            self.serving = self.worker.relay.serving
        if self.serving:
            self.worker.start()

    def follow(self) -> None:
        """A rank other than 0: run rank 0's backend calls until the server stops."""
        self.worker.follow()

    def stop(self) -> None:
        """Rank 0: after the HTTP server; tells the other ranks to stop too. Every rank then
        closes the clients' backends in the same order (collective on Megatron)."""
        if self.serving:
            self.worker.stop()
        self.worker.samplers.close()  # vLLM: its engines and their processes
        self.sessions.close()
        if self._group is not None:
            destroy_process_group(self._group)

    def queue(self, make: type, **fields: object) -> dict[str, str]:
        """Create the future, queue the job, answer the SDK's ``UntypedAPIFuture``."""
        request_id = self.futures.create()
        job: Job = make(request_id=request_id, **fields)
        self.worker.submit(job)
        model_id = fields.get("model_id")
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def next_name(self, prefix: str) -> str:
        with self._lock:
            return f"{prefix}-{next(self._names):06d}"

    def add_sampling(self, session: SamplingSession) -> str:
        with self._lock:
            sid = f"sampler-{len(self.sampling) + 1}"
            self.sampling[sid] = session
        return sid

    def get_sampling(self, sid: str, field: str = "sampling_session_id") -> SamplingSession:
        if sid not in self.sampling:
            raise BadRequest(field, f"is {sid!r}, which is not a sampling session here")
        return self.sampling[sid]
