"""Advantage estimators by name, with what each declares it needs.

An estimator is ``fn(inp: AdvantageInputs, settings: AdvantageSettings) -> AdvantageOutput``.
Register one with `register_advantage_estimator`; or name any such function as
``"package.module:function"`` in ``AdvantageSettings.estimator``. The old-log-prob decision reads
the declarations (`estimator_needs_old_logprobs`), so a function named by path without being
registered is assumed to need the pre-step old log-probs: a forward pass too many is slower but
correct, a missing one is wrong.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from unirl.core.imports import import_callable
from unirl.core.registry import Registry, same_callable

if TYPE_CHECKING:
    from unirl.core.maths.advantages.inputs import AdvantageInputs
    from unirl.core.maths.advantages.output import AdvantageOutput

# The second argument is an `AdvantageSettings`; it is not imported because the settings check
# their ``estimator`` name against this registry (importing both ways would be a circle).
AdvantageEstimator = Callable[["AdvantageInputs", Any], "AdvantageOutput"]

# Modules whose import registers the built-in estimators.
_BUILTIN_MODULES = (
    "unirl.core.maths.advantages.grpo",
    "unirl.core.maths.advantages.rloo",
    "unirl.core.maths.advantages.reinforce_pp",
    "unirl.core.maths.advantages.gae",
)


@attrs.frozen(kw_only=True)
class EstimatorSpec:
    """A registered estimator and its declarations.

    - ``needs_old_logprobs``: reads the sampling policy's log-probs before the optimizer step.
    - ``needs_values``: reads critic values.
    - ``needs_groups``: computes per-group statistics (validated: equal group sizes).
    - ``reads_token_rewards``: credits per-token rewards where they were earned
      (`AdvantageInputs.token_rewards`); the trainer then hands it a sample's
      ``token_rewards`` and the rest of its reward as the outcome, and the others the whole
      reward as one number.
    - ``whitens_over_batch``: the algorithm whitens its advantages over the whole batch;
      `compute_advantages` does it after the call, over every rank of its process group, so the
      function itself returns them un-whitened.
    - ``declared``: False for a ``module:function`` path that was never registered.
    """

    name: str
    fn: AdvantageEstimator
    needs_old_logprobs: bool = False
    needs_values: bool = False
    needs_groups: bool = False
    reads_token_rewards: bool = False
    whitens_over_batch: bool = False
    declared: bool = True

    def __call__(self, inp: AdvantageInputs, settings: Any) -> AdvantageOutput:
        return self.fn(inp, settings)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


ESTIMATORS: Registry[EstimatorSpec] = Registry(
    "advantage estimator",
    key="algorithm.advantage_estimator",
    same=lambda a, b: same_callable(a.fn, b.fn),
    load=_load_builtins,
)


def register_advantage_estimator(
    name: str,
    *,
    needs_old_logprobs: bool = False,
    needs_values: bool = False,
    needs_groups: bool = False,
    reads_token_rewards: bool = False,
    whitens_over_batch: bool = False,
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register ``fn`` under ``name`` with its declared needs."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        spec = EstimatorSpec(
            name=name,
            fn=fn,
            needs_old_logprobs=needs_old_logprobs,
            needs_values=needs_values,
            needs_groups=needs_groups,
            reads_token_rewards=reads_token_rewards,
            whitens_over_batch=whitens_over_batch,
        )
        ESTIMATORS.register(name, spec)
        return fn

    return decorator


def registered_advantage_estimators() -> list[str]:
    return ESTIMATORS.names()


def _resolve_path(path: str) -> EstimatorSpec:
    fn = import_callable(path, key="algorithm.advantage_estimator", what="a custom estimator")
    # A function its module registered carries its declarations.
    for spec in ESTIMATORS.values():
        if spec.fn is fn:
            return spec
    return EstimatorSpec(name=path, fn=fn, needs_old_logprobs=True, declared=False)


def get_advantage_estimator(name: str) -> EstimatorSpec:
    """The estimator registered as ``name``, or the function at ``"package.module:function"``.

    Raises `ConfigError` listing the valid names for an unknown one.
    """
    if ":" in name:
        found = ESTIMATORS.find(name)
        return found if found is not None else _resolve_path(name)
    return ESTIMATORS.get(name, hint="or a custom 'package.module:function'")


def estimator_needs_old_logprobs(name: str) -> bool:
    """Whether the estimator reads pre-step old log-probs (True for undeclared custom ones)."""
    return get_advantage_estimator(name).needs_old_logprobs


def estimator_needs_values(name: str) -> bool:
    """Whether the estimator reads critic values."""
    return get_advantage_estimator(name).needs_values
