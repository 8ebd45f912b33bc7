"""Adapters that run unirl's losses inside other RL frameworks: `unirl.integrations.trl` (a
`GRPOTrainer` subclass) and `unirl.integrations.verl` (verl's policy-loss registry). Each imports
its framework; nothing here is imported by ``import unirl``."""
