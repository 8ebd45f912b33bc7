"""Progress: the microbatch bar of each phase (drawn by one rank, one tick per microbatch, also under
virtual pipeline stages) and the run-level bar with its ETA. Part of the backend protocol, not
run plumbing: every backend advances the bar core hands it."""
