"""Backend-neutral core. At the top: the RL step (`step`), the backend interface (`backend`), the
parallel topology (`topology`) and the old-log-prob decision (`old_logprobs`). Below it, rooms by
kind: `data` (rollout contract, plan, microbatches, context parallel, counts), `maths` (log-probs,
kernels, KL, losses, advantages), `config` (the run's config, its sections, rules and what the
step derives from it), `progress` (the microbatch and run bars) and `run` (metrics, checkpoints,
resume, LR schedule). Nothing here imports a backend, and no room imports one above it."""
