"""User components loaded by `module:function` in the decision tests."""

from unirl.core.maths.advantages import register_advantage_estimator
from unirl.core.maths.losses import register_policy_loss


def undeclared_loss(inp, counts, settings):  # declares nothing: assumed to need old log-probs
    raise NotImplementedError


@register_policy_loss("test_reuse_safe_loss", needs_old_logprobs=False)
def reuse_safe_loss(inp, counts, settings):
    raise NotImplementedError


def undeclared_estimator(inp, settings):
    raise NotImplementedError


@register_advantage_estimator("test_reuse_safe_estimator", needs_old_logprobs=False)
def reuse_safe_estimator(inp, settings):
    raise NotImplementedError
