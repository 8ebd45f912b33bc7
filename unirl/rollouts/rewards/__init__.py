"""Rewards: the registry of reward functions chosen by name (``rollout.reward``), the math answer
checker, and the worker processes that score with a timeout."""
