"""The training loop's weight sync: after every RL step the policy's weights stream
(`unirl.core.weights.stream`) to the rollout source, in buckets of ``rollout.weight_bucket_mb``,
to the ranks its plug-in names (``SourcePlugin.weights``, `weight_receivers`). A source that needs no weights (a
rollout file) gets no stream at all: the step only runs the divergence guard's check of the
local shards (one all-reduce of a flag), so a non-finite policy is still never checkpointed.

Under ``model.lora`` (a backend that `TrainsAdapter`) the sync carries the adapter only
(`unirl.core.weights.adapter`): the run's first sync streams the base weights once
(``stream_base_weights``: exact also on a resumed run, whose merged weights are no longer the
base), which the source keeps; every sync then hands it the policy version's adapter,
``adapter_state_dict()`` (every rank has all of it, so its non-finite check needs no
collective). ``last_bytes``: what the last sync carried (``weight_sync/bytes``).

    sync = WeightSync(cfg, backend, source)
    sync_s = sync.initial(version)                           # before the first rollout
    sync_s = sync.after_step(rl_step, metrics, guard, version)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unirl.core.backend import TrainingBackend, TrainsAdapter
from unirl.core.config.run_config import UnirlConfig
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import weight_receivers
from unirl.core.run.divergence import DivergenceGuard
from unirl.core.weights.adapter import ReceivesAdapter, adapter_bytes, adapter_numel
from unirl.core.weights.fingerprint import SyncVerificationError
from unirl.core.weights.stream import (
    HOST,
    MIB,
    NonFiniteWeightsError,
    WeightBuckets,
    first_non_finite_local,
)


def syncs_adapter(cfg: UnirlConfig) -> bool:
    """Whether a run of ``cfg`` sends the rollout source the adapter only (``model.lora`` and a
    source that receives weights); `unirl.core.weight_sync.WeightSync` then also needs a
    backend that `TrainsAdapter` and a source that `ReceivesAdapter`."""
    return cfg.model.lora is not None and weight_receivers(cfg) != "none"


def adapter_sync_note(cfg: UnirlConfig) -> str | None:
    """What the weight sync carries under ``model.lora`` (`unirl check`); None
    without an adapter or without a sync."""
    lora = cfg.model.lora
    if lora is None or not syncs_adapter(cfg):
        return None
    hf: dict[str, Any] | None = dict(cfg.model.hf_config or {})
    if cfg.model.path is not None:
        config_file = Path(cfg.model.path).expanduser() / "config.json"
        hf = json.loads(config_file.read_text()) if config_file.is_file() else None
    numel = adapter_numel(lora.rank, lora.target_modules, hf) if hf else None
    size = (
        "its size is logged per sync (weight_sync/bytes)"
        if numel is None
        else f"{numel:,} elements, {numel * 4:,} bytes per sync in fp32 (weight_sync/bytes)"
    )
    return (
        f"the adapter only (A and B of {', '.join(lora.target_modules)}, rank {lora.rank}; "
        f"{size}): the run's first sync sends the base weights once (the adapter left out), "
        "which the source keeps, and each sync the policy version's adapter (a serving engine "
        "loads it as a new LoRA request, policy-v<version>)"
        + (
            "; verify_sync checks the adapter it serves and that its base weights never changed"
            if cfg.rollout.verify_sync
            else ""
        )
        + _ahead_note(cfg.train.max_staleness)
    )


def _ahead_note(k: int) -> str:
    """What generating ahead (``train.max_staleness``) does to the adapter-only sync."""
    if not k:
        return ""
    return (
        f"; with train.max_staleness={k} each rollout generated ahead carries a copy of its "
        "policy version's adapter (the base is sent once), which the source loads right before "
        f"generating it: rollout r comes from the base + the adapter after RL step "
        f"max(0, r - {k}), stamped with its policy version"
    )


def _counted(buckets: WeightBuckets, sync: WeightSync) -> WeightBuckets:
    """``buckets`` as they are, their bytes added to ``sync.last_bytes``."""
    for bucket in buckets:
        sync.last_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        yield bucket
        del bucket


def _adapter_receiver(cfg: UnirlConfig, backend: TrainingBackend, source: Any) -> bool:
    """Whether this run syncs the adapter only; a source that cannot take one is a config
    error naming it (checked before the first sync)."""
    if not syncs_adapter(cfg) or not isinstance(backend, TrainsAdapter):
        return False
    if not isinstance(source, ReceivesAdapter):
        raise ConfigError(
            f"model.lora: rollout.source={cfg.rollout.source!r} (here a "
            f"{type(source).__name__}) cannot take an adapter-only weight sync; use "
            "a generating source that keeps its base weights (the built-in sampler or a serving "
            "engine), or rollout.source: file"
        )
    return True


class WeightSync:
    """See the module docstring. ``source``: a `unirl.rollouts.source.RolloutSource`."""

    def __init__(self, cfg: UnirlConfig, backend: TrainingBackend, source: Any) -> None:
        self.backend = backend
        self.source = source
        self.receiver = weight_receivers(cfg)
        self.bucket_bytes = int(cfg.rollout.weight_bucket_mb) * MIB
        # the global rank that receives; None = every rank
        self.dst = 0 if self.receiver == "rank0" else None
        self.adapter_only = _adapter_receiver(cfg, backend, source)
        self.last_bytes = 0

    @property
    def enabled(self) -> bool:
        return self.receiver != "none"

    def _stream(self, base: bool = False) -> WeightBuckets:
        """The stream for a sync, its buckets where the source wants them (its transport's
        device: a GPU for vLLM's IPC / NCCL transports, the host otherwise); ``base``: the
        base weights of an adapter-training backend instead of the policy's."""
        # a source or backend written before ``weights_device`` existed: host buckets
        device = getattr(self.source, "weights_device", None) or HOST
        self.last_bytes = 0
        if base:
            assert isinstance(self.backend, TrainsAdapter)
            stream = self.backend.stream_base_weights(
                self.bucket_bytes, dst=self.dst, device=device
            )
        elif device == HOST:
            stream = self.backend.stream_weights(self.bucket_bytes, dst=self.dst)
        else:
            stream = self.backend.stream_weights(self.bucket_bytes, dst=self.dst, device=device)
        return _counted(stream, self)

    def _send(self, stream: WeightBuckets | dict, version: int) -> None:
        """The full stream, or (adapter only) the adapter, to the source."""
        if isinstance(stream, dict):
            self.last_bytes = adapter_bytes(stream)
            self.source.sync_adapter(stream, policy_version=version)
        else:
            self.source.sync_weights(stream, policy_version=version)

    def _adapter(self) -> dict:
        """The adapter (collective); a non-finite one raises as a stream would, before any sync."""
        assert isinstance(self.backend, TrainsAdapter)
        adapter = self.backend.adapter_state_dict()
        bad = first_non_finite_local(adapter.items())
        if bad is not None:
            raise NonFiniteWeightsError(bad)
        return adapter

    def initial(self, version: int) -> float:
        """The weights the run starts from, to the source (seconds it took; 0 without a sync).
        Adapter only: the base weights (`TrainsAdapter.stream_base_weights`, through the
        source's verified full sync), which the source keeps, then the adapter."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        if self.adapter_only:  # the base weights once, then the adapter
            self.source.sync_weights(self._stream(base=True), policy_version=version)
            base_bytes = self.last_bytes
            self._send(self._adapter(), version)
            self.last_bytes += base_bytes
        else:
            self._send(self._stream(), version)
        return time.perf_counter() - t0

    def after_step(
        self, rl_step: int, metrics: Mapping[str, object], guard: DivergenceGuard, version: int
    ) -> float:
        """Check the weights (the guard stops a diverged run), then sync them; seconds."""
        if not self.enabled:
            guard.after_step(rl_step, metrics, self.backend.non_finite_weight())
            return 0.0
        t0 = time.perf_counter()
        stream: WeightBuckets | dict[str, Any]
        try:  # checks every weight before any bucket exists
            stream = self._adapter() if self.adapter_only else self._stream()
        except NonFiniteWeightsError as exc:
            guard.after_step(rl_step, metrics, exc.parameter)
            raise  # the guard raised already; kept for type checkers
        guard.after_step(rl_step, metrics, None)
        try:
            self._send(stream, version)
        except SyncVerificationError as exc:  # the receiver's check (rollout.verify_sync)
            raise exc.at_step(rl_step) from None
        return time.perf_counter() - t0
