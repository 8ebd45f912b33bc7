"""Rollout post-processing hooks loaded by `module:function` in tests (a module of their own:
importing it registers nothing, so it cannot change a registry another test lists)."""


def zero_rewards_hook(batch, *, rl_step):
    """A rollout post-processing hook: every reward becomes 0 (so a test can see it ran)."""
    import attrs

    from unirl.core.data.rollout import RolloutBatch

    samples = tuple(attrs.evolve(s, reward=0.0) for s in batch.samples)
    return RolloutBatch(samples, origins=batch.origins)


def hook_without_rl_step(batch):
    return batch


def raising_hook(batch, *, rl_step):
    """A hook that fails on every rollout: a run that uses it dies at its first step."""
    raise RuntimeError("this hook always fails")
