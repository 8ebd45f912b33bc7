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


def zero_rewards_hook(batch, *, rl_step):
    """A rollout post-processing hook: every reward becomes 0 (so a test can see it ran)."""
    import attrs

    from unirl.core.data.rollout import RolloutBatch

    samples = tuple(attrs.evolve(s, reward=0.0) for s in batch.samples)
    return RolloutBatch(samples, origins=batch.origins)


def hook_without_rl_step(batch):
    return batch
