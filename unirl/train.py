"""`unirl train`: the whole RL job around the core step.

    rollout -> reward -> advantages -> optimizer steps -> weight sync -> repeat

with metrics (``RUN_DIR/metrics.jsonl``, TensorBoard when installed), checkpoints every
``checkpoint.every`` RL steps and at the end, resume from the newest complete checkpoint, and the
final policy exported in Hugging Face layout (``RUN_DIR/hf``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist
import yaml

from unirl.backends import build_backend
from unirl.core.run import checkpointing
from unirl.core.run.algorithm import needs_reference
from unirl.core.run.config import UnirlConfig, config_from_dict
from unirl.core.run.metrics_log import MetricsLog
from unirl.core.run.progress import RunProgress, progress_enabled
from unirl.core.step import RLStep

logger = logging.getLogger(__name__)

# Shown on the run bar; everything is in metrics.jsonl.
RUN_BAR_KEYS = ("reward/mean", "loss", "kl", "entropy", "grad_norm")


@attrs.frozen(kw_only=True)
class RunSummary:
    run_dir: Path
    steps_done: int
    resumed_from: int | None
    last_metrics: dict[str, float]
    hf_export: Path | None
    reporting: bool  # this process is the one that logs


def with_rollout_file(cfg: UnirlConfig, path: str) -> UnirlConfig:
    data = cfg.to_dict()
    data["rollout"] = {**data["rollout"], "source": "file", "file": path}
    return config_from_dict(data)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def train(cfg: UnirlConfig, *, resume: bool = False) -> RunSummary:
    from unirl.rollouts import build_rollout_source  # needs transformers for the sampler

    run_dir = Path(cfg.logging.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    source = build_rollout_source(cfg)
    total = cfg.train.rl_steps
    if source.num_rollouts is not None and source.num_rollouts < total:
        logger.info(
            "the rollout file holds %d rollouts: running %d RL steps (train.rl_steps=%d)",
            source.num_rollouts, source.num_rollouts, total,
        )  # fmt: skip
        total = source.num_rollouts

    backend = build_backend(
        cfg,
        total_optimizer_steps=total * cfg.layout.optimizer_steps_per_rollout,
        needs_reference=needs_reference(cfg),
    )
    topo = backend.topology
    try:
        start, resumed_from = 0, None
        if resume:
            found = checkpointing.latest_complete(ckpt_root)
            if found is not None:
                resumed_from, path = found
                client = backend.load_checkpoint(path)
                start = int(client["rl_step"])
                source.load_state_dict(client["rollout_source"])
            if topo.is_reporting_rank:
                if found is None:
                    logger.info("--resume: no complete checkpoint in %s, starting fresh", ckpt_root)
                else:
                    logger.info("resumed from %s (RL step %d)", found[1], start)
        if topo.is_reporting_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        metrics_log = (
            MetricsLog(run_dir, tensorboard=cfg.logging.tensorboard, resume_from_step=start)
            if topo.is_reporting_rank
            else None
        )
        source.sync_weights(backend.hf_state_dict())
        rl_step = RLStep(cfg, backend)
        metrics: dict[str, float] = {}
        bars = progress_enabled(cfg.progress.enabled)
        with RunProgress(total, topo, bars, initial=start, show=RUN_BAR_KEYS) as bar:
            for k in range(start, total):
                batch = source.next_rollout(k)
                result = rl_step.run(batch, rl_step=k)
                metrics = result.metrics | {"old_logprobs/source": result.decision.source}
                source.sync_weights(backend.hf_state_dict())
                if metrics_log is not None:
                    metrics_log.write(k + 1, metrics)
                done = k + 1
                if done == total or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0):
                    _save(backend, ckpt_root, done, cfg, source, topo.is_reporting_rank)
                bar.advance(metrics)
        export = None
        if cfg.checkpoint.export_hf:
            export = run_dir / "hf"
            backend.export_hf(export)
            _barrier()
            if topo.is_reporting_rank:
                logger.info("policy exported in Hugging Face layout to %s", export)
        if metrics_log is not None:
            metrics_log.close()
        return RunSummary(
            run_dir=run_dir,
            steps_done=total,
            resumed_from=resumed_from,
            last_metrics={k: v for k, v in metrics.items() if isinstance(v, float)},
            hf_export=export,
            reporting=topo.is_reporting_rank,
        )
    finally:
        backend.close()


def _save(
    backend: Any, root: Path, done: int, cfg: UnirlConfig, source: Any, reporting: bool
) -> None:
    path = checkpointing.step_dir(root, done)
    client = {"rl_step": done, "config": cfg.to_dict(), "rollout_source": source.state_dict()}
    backend.save_checkpoint(path, client)  # collective; complete (marker written) on return
    if reporting:
        checkpointing.prune(root, cfg.checkpoint.keep)
        logger.info("checkpoint saved: %s", path)
    _barrier()
