"""The work a request queues: what it needs, checked, with the future it completes. Built by
the routes (`unirl.serve.app`), run in order by the worker (`unirl.serve.worker`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from unirl.core.backend import AdamStepSettings
from unirl.core.maths.losses.settings import LossSettings
from unirl.serve.batching import TokenDatum
from unirl.serve.sampling import SampleJob
from unirl.serve.state import StatePath


@attrs.frozen(kw_only=True)
class CreateJob:
    request_id: str
    model_id: str
    base_model: str
    weights: Path  # the base model's folder
    lora: Mapping[str, Any]  # model.lora


@attrs.frozen(kw_only=True)
class FwdBwdJob:
    request_id: str
    model_id: str
    loss_fn: str
    settings: LossSettings
    forward_only: bool
    datums: tuple[TokenDatum, ...]

    @property
    def batch_key(self) -> tuple[str, str, LossSettings, bool]:
        """Jobs with one key can run as one backend call."""
        return (self.model_id, self.loss_fn, self.settings, self.forward_only)


@attrs.frozen(kw_only=True)
class OptimJob:
    request_id: str
    model_id: str
    settings: AdamStepSettings


@attrs.frozen(kw_only=True)
class SaveJob:
    request_id: str
    model_id: str
    path: StatePath
    # save_weights_and_get_sampling_client: the sampling session answered with the path
    sampling_session_id: str | None = None


@attrs.frozen(kw_only=True)
class LoadJob:
    """``base_model`` set: create the client ``model_id`` from the state (create-from-state);
    else replace the existing client's state."""

    request_id: str
    model_id: str
    path: StatePath
    folder: Path
    optimizer: bool
    base_model: str | None


@attrs.frozen(kw_only=True)
class SampleWork:
    request_id: str
    job: SampleJob
    # record_stability_info: keep each sequence for stable_reinforce (`unirl.serve.stability`)
    record_stability: bool


Job = CreateJob | FwdBwdJob | OptimJob | SaveJob | LoadJob | SampleWork
