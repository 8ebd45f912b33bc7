"""Data layout: the rollout data contract and its file I/O, the microbatch plan, the training
microbatch, the context-parallel split and the global counts of an optimizer step."""
