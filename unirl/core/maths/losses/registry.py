"""Policy losses by name, and whether each needs the pre-step ("old") log-probs.

Every policy loss has one signature::

    fn(inp: LossInputs, counts: GlobalCounts, settings: LossSettings)
        -> tuple[loss_t: Tensor [T], metrics: dict[str, Metric]]

It returns a PER-TOKEN loss (values at masked tokens are ignored); `compute_loss` applies the
rollout-correction weight and the chosen aggregation, so every loss gets every aggregation mode
and the microbatch-invariance guarantee for free. A user loss is either registered with
`register_policy_loss` (in a module the run imports) or named as ``"package.module:function"``.

Whether a loss needs old log-probs from *before* the first optimizer step — values the training
forward's own detached log-probs cannot stand in for — decides whether a whole forward pass can be
skipped, so it is declared, not guessed: a function without a ``needs_old_logprobs`` attribute is
assumed to need them (the safe answer). The built-in losses read ``old_logprobs`` but are exact
with the reused ones on a single on-policy step (the ratio is 1), so they declare False.

Whether a loss is ``separable`` — each token's loss a function of that token's own log-prob (and
of data fixed before the forward), so a token's gradient needs no other token's log-prob — decides
whether the fused head can take the loss into each token chunk (`unirl.core.maths.head_loss`,
three head matmuls instead of four). Also declared: undeclared losses are assumed not to be.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unirl.core.imports import import_callable
from unirl.core.registry import Registry, same_callable

if TYPE_CHECKING:
    from unirl.core.data.counts import GlobalCounts
    from unirl.core.maths.losses.inputs import LossInputs
    from unirl.core.maths.losses.metrics import Metric

# The third argument is a `LossSettings`; it is not imported because the settings check their
# ``policy_loss`` name against this registry (importing both ways would be a circle).
PolicyLossFn = Callable[
    ["LossInputs", "GlobalCounts", Any], tuple[torch.Tensor, dict[str, "Metric"]]
]

# Modules whose import registers the built-in losses.
_BUILTIN_MODULES = (
    "unirl.core.maths.losses.ppo_clip",
    "unirl.core.maths.losses.gspo",
    "unirl.core.maths.losses.cispo",
    "unirl.core.maths.losses.dro",
    "unirl.core.maths.losses.reinforce",
    "unirl.core.maths.losses.stable_reinforce",
    "unirl.core.maths.losses.sft",
)


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", key="algorithm.policy_loss", same=same_callable, load=_load_builtins
)


def register_policy_loss(
    name: str,
    *,
    needs_old_logprobs: bool = True,
    separable: bool = False,
    reads_behaviour: bool = False,
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: register ``fn`` under ``name`` and record whether it needs pre-step log-probs,
    whether it is separable over tokens (see the module docstring) and whether it measures the
    learner against the behaviour log-probs itself (``rollout_logprobs``, when the batch has
    them), so that no other off-policy weight belongs on top of it."""

    def register(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES.register(name, fn)
        fn.needs_old_logprobs = needs_old_logprobs  # type: ignore[attr-defined]
        fn.separable = separable  # type: ignore[attr-defined]
        fn.reads_behaviour = reads_behaviour  # type: ignore[attr-defined]
        return fn

    return register


def registered_policy_losses() -> list[str]:
    return POLICY_LOSSES.names()


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as ``name``, or the function ``"package.module:function"``."""
    if ":" in name:
        return import_callable(name, key="algorithm.policy_loss", what="a custom loss")
    return POLICY_LOSSES.get(name, hint="or a custom loss as 'package.module:function'")


def policy_loss_needs_old_logprobs(name: str) -> bool:
    """Whether the loss needs pre-step log-probs; undeclared custom losses are assumed to."""
    return bool(getattr(get_policy_loss(name), "needs_old_logprobs", True))


def policy_loss_is_separable(name: str) -> bool:
    """Whether each token's loss depends on no other token's log-prob; undeclared custom losses
    are assumed not to be (a custom function may set ``fn.separable = True``)."""
    return bool(getattr(get_policy_loss(name), "separable", False))


def policy_loss_reads_behaviour(name: str) -> bool:
    """Whether the loss reads the behaviour log-probs itself (stable_reinforce's sampler
    log-probs): `algorithm.decoupled: auto` then adds no proximal / behaviour weight."""
    return bool(getattr(get_policy_loss(name), "reads_behaviour", False))
