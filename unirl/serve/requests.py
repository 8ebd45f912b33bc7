"""JSON request bodies -> checked jobs. Each check names the field as the SDK sends it."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from unirl.core.backend import AdamStepSettings
from unirl.serve.errors import BadRequest

_ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


def require(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in body or body[key] is None:
        raise BadRequest(key, "is missing")
    if not isinstance(body[key], kind):
        raise BadRequest(key, f"is {body[key]!r}; expected {getattr(kind, '__name__', kind)}")
    return body[key]


def adam_settings(body: Mapping[str, Any]) -> AdamStepSettings:
    params = body.get("adam_params")
    if params is None:
        if body.get("optimizer_params") is not None:
            raise BadRequest(
                "optimizer_params", "names a non-Adam optimizer; this server runs Adam"
            )
        raise BadRequest("adam_params", "is missing")
    unknown = sorted(set(params) - set(_ADAM_DEFAULTS))
    if unknown:
        raise BadRequest("adam_params", f"has unknown key(s) {unknown}")
    values = {k: params.get(k, default) for k, default in _ADAM_DEFAULTS.items()}
    for key, value in values.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise BadRequest(f"adam_params.{key}", f"is {value!r}; a finite number >= 0")
    for key in ("beta1", "beta2"):
        if values[key] >= 1:
            raise BadRequest(f"adam_params.{key}", f"is {values[key]}; it must be < 1")
    return AdamStepSettings(
        lr=float(values["learning_rate"]),
        beta1=float(values["beta1"]),
        beta2=float(values["beta2"]),
        eps=float(values["eps"]),
        weight_decay=float(values["weight_decay"]),
        grad_clip=float(values["grad_clip_norm"]),
    )


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > limit:
        raise BadRequest(
            "body", f"is {len(raw)} bytes, over serve.max_request_bytes={limit}", status=413
        )
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as exc:
        raise BadRequest("body", f"is not JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    return body
