"""Run plumbing: the metrics log (and W&B), checkpoint mechanics, resume, the run directory, the LR
schedule and the divergence stop."""
