"""Backend-neutral core: config, topology, progress, the old-log-prob decision, the rollout
data contract, log-probs, losses and advantage estimators. Nothing here imports a backend."""
