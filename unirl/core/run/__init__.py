"""Run plumbing: the config, progress bars, the metrics log, checkpoint mechanics, the LR
schedule, and the config turned into the maths' settings."""
