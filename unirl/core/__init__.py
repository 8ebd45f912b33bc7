"""Backend-neutral core. At the top: the RL step (`step`), the backend interface (`backend`), the
parallel topology (`topology`) and the old-log-prob decision (`old_logprobs`). Below it, three
rooms: `data` (rollout contract, plan, microbatches, context parallel, counts), `maths` (log-probs,
kernels, KL, losses, advantages) and `run` (config, progress, metrics, checkpoints, LR schedule).
Nothing here imports a backend."""
