"""`compute_advantages`: the one call the RL step makes, once per rollout, before the optimizer
steps.

Order: the registered estimator (with its own batch whitening for REINFORCE++), then on-policy
distillation shaping when ``distillation_coef > 0``, then optional whitening of the result.
Advantages are constants of the loss, so everything runs without autograd.
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.advantages.inputs import AdvantageInputs
from unirl.core.maths.advantages.output import AdvantageOutput
from unirl.core.maths.advantages.registry import EstimatorSpec, get_advantage_estimator
from unirl.core.maths.advantages.settings import AdvantageSettings
from unirl.core.maths.advantages.shaping import apply_distillation
from unirl.core.maths.advantages.whitening import masked_whiten


def _check_output(out: Any, inp: AdvantageInputs, spec: EstimatorSpec) -> None:
    # Custom estimators are code we did not write: refuse garbage here, not in the loss.
    if not isinstance(out, AdvantageOutput):
        raise LossInputError(
            f"advantage estimator {spec.name!r} returned {type(out).__name__}; it must return "
            "AdvantageOutput(advantages=[B, L], returns=[B, L])"
        )
    shape = tuple(inp.response_mask.shape)
    for name in ("advantages", "returns"):
        x = getattr(out, name)
        if tuple(x.shape) != shape:
            raise LossInputError(
                f"advantage estimator {spec.name!r} returned {name} of shape {tuple(x.shape)}; "
                f"expected [B, L]={shape} like response_mask"
            )
        bad = ~torch.isfinite(x) & inp.mask
        if bool(bad.any()):
            rows = bad.any(dim=1).nonzero().flatten()[:5].tolist()
            raise LossInputError(
                f"advantage estimator {spec.name!r} returned non-finite {name} on valid tokens "
                f"of samples {rows}"
            )


def compute_advantages(
    inp: AdvantageInputs, settings: AdvantageSettings, *, group: Any = None
) -> AdvantageOutput:
    """Advantages and returns ``[B, L]`` of one rollout, zero outside the response mask.

    ``group`` is the process group whose ranks together hold the batch (disjoint samples); batch
    whitening uses statistics over all of them. Group-relative estimators need each group's
    samples on one rank. Raises `LossInputError` for inputs that do not fit.
    """
    spec = get_advantage_estimator(settings.estimator)
    inp.validate(needs_groups=spec.needs_groups)
    if spec.needs_values:
        inp.require(("values",), by=f"estimator {spec.name!r}")
    if settings.distillation_coef > 0:
        inp.require(
            ("old_logprobs", "teacher_logprobs"),
            by=f"AdvantageSettings.distillation_coef={settings.distillation_coef}",
        )
    mask = inp.mask
    with torch.no_grad():
        out = spec(inp, settings)
        _check_output(out, inp, spec)
        advantages = out.advantages
        if spec.whitens_over_batch:
            advantages = masked_whiten(advantages, mask, group=group)
        if settings.distillation_coef > 0:
            advantages = apply_distillation(
                advantages, inp.old_logprobs, inp.teacher_logprobs, mask, settings.distillation_coef
            )
        if settings.whiten:
            advantages = masked_whiten(advantages, mask, group=group)
        return AdvantageOutput(
            advantages=torch.where(mask, advantages, 0.0),
            returns=torch.where(mask, out.returns, 0.0),
        )
