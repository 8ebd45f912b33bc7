"""The training loop's weight sync: after every RL step the policy's weights stream
(`unirl.core.weights.stream`) to the rollout source, in buckets of ``rollout.weight_bucket_mb``,
to the ranks its plug-in names (``SourcePlugin.weights``, `weight_receivers`). A source that needs no weights (a
rollout file) gets no stream at all: the step only runs the divergence guard's check of the
local shards (one all-reduce of a flag), so a non-finite policy is still never checkpointed.

    sync = WeightSync(cfg, backend, source)
    sync_s = sync.initial(version)                           # before the first rollout
    sync_s = sync.after_step(rl_step, metrics, guard, version)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from unirl.core.backend import TrainingBackend
from unirl.core.config.run_config import UnirlConfig
from unirl.core.protocols.source_plugin import weight_receivers
from unirl.core.run.divergence import DivergenceGuard
from unirl.core.weights.fingerprint import SyncVerificationError
from unirl.core.weights.stream import (
    HOST,
    MIB,
    NonFiniteWeightsError,
    WeightBuckets,
)


class WeightSync:
    """See the module docstring. ``source``: a `unirl.rollouts.source.RolloutSource`."""

    def __init__(self, cfg: UnirlConfig, backend: TrainingBackend, source: Any) -> None:
        self.backend = backend
        self.source = source
        self.receiver = weight_receivers(cfg)
        self.bucket_bytes = int(cfg.rollout.weight_bucket_mb) * MIB
        # the global rank that receives; None = every rank
        self.dst = 0 if self.receiver == "rank0" else None

    @property
    def enabled(self) -> bool:
        return self.receiver != "none"

    def _stream(self) -> WeightBuckets:
        """The stream for a sync, its buckets where the source wants them (its transport's
        device: a GPU for vLLM's IPC / NCCL transports, the host otherwise)."""
        # a source or backend written before ``weights_device`` existed: host buckets
        device = getattr(self.source, "weights_device", None) or HOST
        if device == HOST:
            return self.backend.stream_weights(self.bucket_bytes, dst=self.dst)
        return self.backend.stream_weights(self.bucket_bytes, dst=self.dst, device=device)

    def initial(self, version: int) -> float:
        """The weights the run starts from, to the source (seconds it took; 0 without a sync)."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        self.source.sync_weights(self._stream(), policy_version=version)
        return time.perf_counter() - t0

    def after_step(
        self, rl_step: int, metrics: Mapping[str, object], guard: DivergenceGuard, version: int
    ) -> float:
        """Check the weights (the guard stops a diverged run), then sync them; seconds."""
        if not self.enabled:
            guard.after_step(rl_step, metrics, self.backend.non_finite_weight())
            return 0.0
        t0 = time.perf_counter()
        try:
            stream = self._stream()  # checks every weight before any bucket exists
        except NonFiniteWeightsError as exc:
            guard.after_step(rl_step, metrics, exc.parameter)
            raise  # the guard raised already; kept for type checkers
        guard.after_step(rl_step, metrics, None)
        try:
            self.source.sync_weights(stream, policy_version=version)
        except SyncVerificationError as exc:  # the receiver's check (rollout.verify_sync)
            raise exc.at_step(rl_step) from None
        return time.perf_counter() - t0
