"""Backend-neutral core. At the top: the RL step (`step`), the backend interface (`backend`), the
parallel topology (`topology`), the old-log-prob decision (`old_logprobs`) and the training
loop's weight sync (`weight_sync`). Below it, rooms by kind: `data` (rollout contract, plan,
microbatches, context parallel, counts), `maths` (log-probs, kernels, KL, losses, advantages),
`config` (the run's config, its sections, rules and what the step derives from it), `protocols`
(the plug-in registries and the typed config view their rules read: below `config`, which is
built from them), `weights` (the weight stream and its fingerprint), `progress` (the microbatch
and run bars) and `run` (metrics, checkpoints, resume, LR schedule). Nothing here imports a
backend, and no room imports one above it."""
