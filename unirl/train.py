"""`unirl train`: the whole RL job around the core step.

    rollout -> reward -> advantages -> optimizer steps -> weight sync -> repeat

with metrics (``RUN_DIR/metrics.jsonl``, TensorBoard when installed), checkpoints every
``checkpoint.every`` RL steps and at the end, resume from the newest complete checkpoint, and the
final policy exported in Hugging Face layout (``RUN_DIR/hf``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch.distributed as dist
import yaml

from unirl.backends import build_backend, watchdog
from unirl.core.config.derived import needs_reference
from unirl.core.config.paths import check_local_paths
from unirl.core.config.run_config import UnirlConfig, config_from_dict, policy_rl_steps
from unirl.core.critic import critic_summary
from unirl.core.errors import CollectiveTimeoutError, ConfigError, RunError
from unirl.core.progress.bars import (
    GenerationProgress,
    RunProgress,
    logs_step,
    progress_enabled,
)
from unirl.core.run import checkpointing
from unirl.core.run import run_dir as run_dirs
from unirl.core.run.divergence import DivergenceGuard
from unirl.core.run.metrics_log import MetricsLog
from unirl.core.run.resume import check_resume_fits
from unirl.core.run.wandb_log import WandbLog
from unirl.core.source_plugin import SOURCES
from unirl.core.step import RLStep
from unirl.core.weight_stream import MIB
from unirl.core.weight_sync import WeightSync
from unirl.log_setup import apply_log_level

if TYPE_CHECKING:
    from unirl.core.data.rollout import RolloutBatch
    from unirl.rollouts.async_source import RolloutsAhead

logger = logging.getLogger(__name__)

# Shown on the run bar; everything is in metrics.jsonl.
RUN_BAR_KEYS = ("reward/mean", "loss", "kl", "entropy", "grad_norm", "critic/value_loss")


@attrs.frozen(kw_only=True)
class RunSummary:
    run_dir: Path
    steps_done: int
    resumed_from: int | None
    last_metrics: dict[str, float]
    hf_export: Path | None
    reporting: bool  # this process is the one that logs


def with_rollout_file(cfg: UnirlConfig, path: str) -> UnirlConfig:
    """``cfg`` reading its rollouts from ``path`` (``--rollouts``); the section of the source it
    named before is dropped with it."""
    data = cfg.to_dict()
    rollout = {k: v for k, v in data["rollout"].items() if k not in SOURCES}
    data["rollout"] = {**rollout, "source": "file", "file": path}
    return config_from_dict(data)


def _initial_policy_version(cfg: UnirlConfig, client: dict[str, Any] | None) -> int:
    """The optimizer steps the policy has taken before the first RL step of this run: 0 on a
    fresh run, the checkpoint's count on resume (derived from its RL step for a checkpoint
    written before the count was saved)."""
    if client is None:
        return 0
    if "policy_version" in client:
        return int(client["policy_version"])
    done = max(0, policy_rl_steps(cfg, int(client["rl_step"])))
    return done * cfg.layout.optimizer_steps_per_rollout


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _same_on_every_rank(value: str) -> str:
    """Rank 0's `value` on every rank (the run id must be one per run)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])
    return value


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def train(cfg: UnirlConfig, *, resume: bool = False, overwrite: bool = False) -> RunSummary:
    """Run the job. `resume` continues the run in ``logging.run_dir`` from its newest verified
    checkpoint; `overwrite` deletes a previous run there first. Without either, a directory that
    holds another run is refused (`ConfigError`) before anything is built or written."""
    from unirl.rollouts import build_rollout_source  # needs transformers for the sampler
    from unirl.rollouts.async_source import RolloutsAhead
    from unirl.rollouts.async_source import restore as restore_rollouts
    from unirl.rollouts.build import save_run_tokenizer
    from unirl.rollouts.eval import build_evaluator
    from unirl.rollouts.postprocess import apply_postprocess_hook, load_postprocess_hook
    from unirl.rollouts.source import policy_version_metrics

    apply_log_level(cfg.logging.level)
    run_dir = Path(cfg.logging.run_dir)
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    # Before any work: the directories can be written, and they hold no other run.
    run_dirs.check_writable(run_dir, "logging.run_dir")
    run_dirs.check_writable(
        ckpt_root, "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir"
    )
    check_local_paths(cfg)
    resumed_id = run_dirs.claim(run_dir, ckpt_root, resume=resume, overwrite=overwrite)
    found = checkpointing.latest_complete(ckpt_root) if resume else None
    if found is not None:
        check_resume_fits(found[1], cfg, run_id=resumed_id)
    source = build_rollout_source(cfg)
    hook = load_postprocess_hook(cfg)
    # the eval section's prompts, read and checked before the backend is built; its reward
    # workers, if any, start at its first run
    evaluator = build_evaluator(cfg, source)
    total = cfg.train.rl_steps
    if source.num_rollouts is not None and source.num_rollouts < total:
        logger.info(
            "the rollout file holds %d rollouts: running %d RL steps (train.rl_steps=%d)",
            source.num_rollouts, source.num_rollouts, total,
        )  # fmt: skip
        total = source.num_rollouts

    policy_steps = policy_rl_steps(cfg, total)
    if policy_steps < 1:
        raise ConfigError(
            f"critic.warmup_steps={cfg.critic.warmup_steps} leaves the policy no RL step of the "
            f"{total} this run takes (the rollout file's length); lower critic.warmup_steps"
        )
    backend = build_backend(
        cfg,
        # the policy's steps (its LR schedule); the critic adds its warm-up steps
        total_optimizer_steps=policy_steps * cfg.layout.optimizer_steps_per_rollout,
        needs_reference=needs_reference(cfg),
    )
    topo = backend.topology
    timed_out = False
    # train.max_staleness > 0: rollouts generated ahead, in a worker (rollouts/async_source)
    ahead: RolloutsAhead | None = None
    try:
        run_id = _same_on_every_rank(resumed_id or run_dirs.new_run_id())
        if _is_rank0():
            if overwrite:
                run_dirs.clear_previous_run(run_dir, ckpt_root)
            run_dirs.write_run_id(run_dir, run_id)
        _barrier()
        start, resumed_from, client = 0, None, None
        if cfg.train.max_staleness:
            bucket_bytes = int(cfg.rollout.weight_bucket_mb) * MIB
            ahead = RolloutsAhead(source, cfg.train.max_staleness, bucket_bytes=bucket_bytes)
        if resume:
            if found is not None:
                resumed_from, path = found
                client = backend.load_checkpoint(path)
                start = int(client["rl_step"])
                restore_rollouts(source, ahead, client["rollout_source"])
            if topo.is_reporting_rank:
                if found is None:
                    logger.info("--resume: no complete checkpoint in %s, starting fresh", ckpt_root)
                else:
                    logger.info("resumed from %s (RL step %d)", found[1], start)
        if topo.is_reporting_rank:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        metrics_log = (
            MetricsLog(
                run_dir,
                tensorboard=cfg.logging.tensorboard,
                resume_from_step=start,
                wandb=None
                if cfg.logging.wandb is None
                else WandbLog(cfg.logging.wandb, run_dir, run_id=run_id, config=cfg.to_dict()),
            )
            if topo.is_reporting_rank
            else None
        )
        # The optimizer steps the policy has taken: the version of the weights each sync sends.
        version = _initial_policy_version(cfg, client)
        sync = WeightSync(cfg, backend, source)
        # Logged with the step whose rollout came from the weights this sync delivered.
        sync_s = 0.0
        if ahead is None:
            sync_s = sync.initial(version)
        else:  # the first k rollouts: restored, or generated from the weights we start from
            for r in range(start, start + ahead.max_staleness):
                if not ahead.has(r):
                    ahead.submit(r, sync.snapshot(), version)
        rl_step = RLStep(cfg, backend)
        if topo.is_reporting_rank and backend.critic is not None:
            logger.info("critic: %s", critic_summary(cfg))
        guard = DivergenceGuard(cfg.train.max_consecutive_skipped_steps)
        metrics: dict[str, float] = {}
        bars = progress_enabled(cfg.progress.enabled)
        every = cfg.progress.log_every
        # reading finished rollouts (a file) is no phase worth a bar
        generates = SOURCES.get(cfg.rollout.source).generates
        with RunProgress(
            total, topo, bars, initial=start, show=RUN_BAR_KEYS, log_every=every
        ) as bar:
            for k in range(start, total):
                t0 = time.perf_counter()
                async_metrics: dict[str, float] = {}
                if ahead is not None:
                    batch, generation_s, sync_s, async_metrics = _take_ahead(
                        ahead, k, sync, version
                    )
                elif generates:
                    with GenerationProgress(
                        "generate",
                        cfg.layout.rollout_samples,
                        topo,
                        enabled=bars,
                        log_summary=logs_step(k + 1, every, total),
                    ) as gen_bar:
                        batch = source.next_rollout(k, progress=gen_bar)
                else:
                    batch = source.next_rollout(k)
                if ahead is None:
                    generation_s = time.perf_counter() - t0
                if hook is not None:
                    batch = apply_postprocess_hook(
                        hook, batch, k, str(cfg.algorithm.rollout_postprocess_hook)
                    )
                result = rl_step.run(batch, rl_step=k, policy_version=version)
                metrics = (
                    result.metrics
                    | policy_version_metrics(batch, version)
                    | async_metrics
                    | {
                        "old_logprobs/source": result.decision.source,
                        "time/generation_s": generation_s,
                        "time/weight_sync_s": sync_s,
                    }
                )
                version += int(result.metrics["optimizer_steps"])
                if metrics_log is not None:
                    metrics_log.write(k + 1, metrics)
                # the non-finite check comes before any sync, save or export
                if ahead is None:
                    sync_s = sync.after_step(k + 1, metrics, guard, version)
                else:  # the worker syncs its own snapshot (`_take_ahead`)
                    guard.after_step(k + 1, metrics, backend.non_finite_weight())
                done = k + 1
                if evaluator is not None and evaluator.due(done, total):
                    with bar.excluded():  # an eval is not a step: keep it out of the ETA
                        eval_metrics = evaluator.run(done)
                    if metrics_log is not None:
                        metrics_log.write(done, eval_metrics)
                if done == total or (cfg.checkpoint.every and done % cfg.checkpoint.every == 0):
                    with bar.excluded():  # a save is not a step: keep it out of the ETA
                        _save(
                            backend, ckpt_root, done, version, cfg, ahead or source, run_id,
                            topo.is_reporting_rank,
                        )  # fmt: skip
                bar.advance(metrics)
        export = None
        if cfg.checkpoint.export_hf:
            export = run_dir / "hf"
            backend.export_hf(export)
            if _is_rank0():  # the tokenizer the rollouts used, for AutoTokenizer and engines
                save_run_tokenizer(cfg, export)
            _barrier()
            if topo.is_reporting_rank:
                logger.info("policy exported in Hugging Face layout to %s", export)
            if backend.critic is not None:
                backend.critic.export_hf(run_dir / "hf_critic")
                _barrier()
                if topo.is_reporting_rank:
                    logger.info(
                        "critic exported in Hugging Face layout to %s", run_dir / "hf_critic"
                    )
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
    except Exception as exc:
        if not watchdog.is_collective_timeout(exc):
            raise
        timed_out = True  # the process group cannot be torn down: the CLI exits at once
        killed = watchdog.stop_unresponsive_peers()
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CollectiveTimeoutError(
            f"rank {rank}: a collective waited parallel.timeout_s for another rank that stopped "
            f"answering (hung, stopped or dead; {len(killed)} rank(s) on this host stopped); the "
            "newest complete checkpoint is intact: fix the cause and run again with --resume "
            "(raise parallel.timeout_s if a rank is only slow)"
        ) from exc
    finally:
        if ahead is not None:
            ahead.close()
        if evaluator is not None:
            evaluator.close()
        source.close()  # an engine's processes go also when the run failed
        if not timed_out:
            backend.close()


def _take_ahead(
    ahead: RolloutsAhead, k: int, sync: WeightSync, version: int
) -> tuple[RolloutBatch, float, float, dict[str, float]]:
    """train.max_staleness > 0: queue rollout k + max_staleness from the weights now (version
    ``version``), then take rollout k (unirl.rollouts.async_source has the schedule). Returns the
    batch, its generation and weight-sync seconds in the worker, and the async metrics."""
    from unirl.rollouts.async_source import staleness_metrics

    # Queued even past the run's last step: the final checkpoint then holds the rollouts a
    # --resume with more train.rl_steps continues from, exactly.
    ahead.submit(k + ahead.max_staleness, sync.snapshot(), version)
    generated, wait_s = ahead.take(k)
    busy = generated.sync_s + generated.generation_s
    metrics = staleness_metrics(generated.batch, version) | {
        "time/rollout_wait_s": wait_s,  # the trainer idle, waiting for the rollout
        "time/overlap_s": max(0.0, busy - wait_s),  # its generation hidden behind training
        "time/generator_idle_s": generated.idle_s,  # the worker waiting for these weights
    }
    return generated.batch, generated.generation_s, generated.sync_s, metrics


def _write_error(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return "a file could not be written: disk full or file size limit reached"


def _save(
    backend: Any,
    root: Path,
    done: int,
    policy_version: int,
    cfg: UnirlConfig,
    source: Any,
    run_id: str,
    reporting: bool,
) -> None:
    path = checkpointing.step_dir(root, done)
    client = {
        "rl_step": done,
        "policy_version": policy_version,
        "run_id": run_id,
        "config": cfg.to_dict(),
        "rollout_source": source.state_dict(),
    }
    try:
        backend.save_checkpoint(path, client)  # collective; complete (marker written) on return
    except (OSError, RuntimeError) as exc:
        # A full disk or a directory made read-only during the run. torch.save reports a
        # failed write as a RuntimeError of its zip writer (inline_container.cc), without the
        # errno; any other RuntimeError is not ours to reword.
        if not isinstance(exc, OSError) and "inline_container" not in str(exc):
            raise
        # The half-written folder is a .partial that resume never picks; the newest complete
        # checkpoint is untouched.
        latest = checkpointing.latest_complete(root)
        keep = (
            f"the newest complete checkpoint {latest[1]} is intact"
            if latest
            else "no earlier checkpoint exists"
        )
        raise RunError(
            f"writing checkpoint {path} failed ({_write_error(exc)}); {keep}. Free disk space "
            "(or fix the directory) and run again with --resume"
        ) from exc
    if reporting:
        checkpointing.prune(root, cfg.checkpoint.keep, run_id)
        logger.info("checkpoint saved: %s", path)
    _barrier()
