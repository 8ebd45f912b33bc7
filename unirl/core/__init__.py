"""Backend-neutral core. At the top: the RL step (`step`), the backend interface (`backend`), the
parallel topology (`topology`) and the old-log-prob decision (`old_logprobs`). Below it, rooms by
kind: `data` (rollout contract, plan, microbatches, context parallel, counts), `maths` (log-probs,
kernels, KL, losses, advantages), `config` (the run's config, its sections, rules and what the
step derives from it), `progress` (the microbatch and run bars) and `run` (metrics, checkpoints,
resume, LR schedule). The plug-in registries (`backend_plugin`, `source_plugin`) sit below
`config`, which is built from them; they read the config by its typed view (`config_view`).
Nothing here imports a backend, and no room imports one above it."""
