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
from unirl.core.backend import TrainsAdapter
from unirl.core.config.derived import needs_reference
from unirl.core.config.paths import check_local_paths
from unirl.core.config.run_config import UnirlConfig, config_from_dict, policy_rl_steps
from unirl.core.critic import critic_summary
from unirl.core.errors import CollectiveTimeoutError, ConfigError, RunError, WaitTimeoutError
from unirl.core.old_logprobs import configured_staleness, decide_old_logprobs
from unirl.core.progress.bars import (
    GenerationProgress,
    RunProgress,
    logs_step,
    progress_enabled,
)
from unirl.core.protocols.source_plugin import SOURCES
from unirl.core.run import checkpointing
from unirl.core.run import run_dir as run_dirs
from unirl.core.run.completions_log import CompletionsLog
from unirl.core.run.divergence import DivergenceGuard
from unirl.core.run.metrics_log import MetricsLog
from unirl.core.run.resume import check_resume_fits
from unirl.core.run.wandb_log import WandbLog
from unirl.core.step import RLStep
from unirl.core.weight_sync import WeightSync
from unirl.log_setup import apply_log_level

if TYPE_CHECKING:
    from unirl.core.backend import TrainingBackend
    from unirl.core.data.rollout import RolloutBatch
    from unirl.rollouts.source import RolloutSource

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
    apply_log_level(cfg.logging.level)
    job = _Job.open(cfg, resume=resume, overwrite=overwrite)
    timed_out = False
    try:
        job.start()
        job.loop()
        return job.finish()
    except Exception as exc:
        if isinstance(exc, WaitTimeoutError):  # named already; its wait is still pending
            timed_out = True
            raise
        lost = isinstance(exc, CollectiveTimeoutError)  # a wait of unirl's own gave up on a rank
        if not (lost or watchdog.is_collective_timeout(exc) or watchdog.is_peer_gone(exc)):
            raise
        timed_out = True  # the process group cannot be torn down: the CLI exits at once
        raise _collective_timeout() from exc
    finally:
        job.close(backend=not timed_out)


def _collective_timeout() -> CollectiveTimeoutError:
    """The error of a run whose collective timed out, after the peers on this host stopped."""
    killed = watchdog.stop_unresponsive_peers()
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveTimeoutError(
        f"rank {rank}: a collective lost another rank, which died or stopped answering within "
        f"parallel.timeout_s (hung, stopped or killed; {len(killed)} rank(s) on this host "
        "stopped; the first rank's own error, if it had one, says why); the "
        "newest complete checkpoint is intact: fix the cause and run again with --resume "
        "(raise parallel.timeout_s if a rank is only slow)"
    )


class _Job:
    """One run's state: `open` checks and builds (nothing written yet), `start` claims the run
    directory and resumes, `loop` runs the RL steps, `finish` exports, `close` releases."""

    def __init__(
        self,
        cfg: UnirlConfig,
        *,
        source: RolloutSource,
        backend: TrainingBackend,
        total: int,
        resume: bool,
        overwrite: bool,
    ) -> None:
        self.cfg, self.source, self.backend, self.total = cfg, source, backend, total
        self.resume, self.overwrite = resume, overwrite
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = _checkpoint_root(cfg)
        self.topo = backend.topology
        # set by `open` after the checks, by `start` and by `loop`
        self.resumed_id: str | None = None
        self.found: tuple[int, Path] | None = None
        self.hook: Any = None
        self.evaluator: Any = None
        self.run_id = ""
        self.start_step = 0
        self.resumed_from: int | None = None
        self.version = 0  # the optimizer steps the policy has taken: each sync sends it
        self.metrics_log: MetricsLog | None = None
        self.completions: CompletionsLog | None = None
        self.sync: WeightSync | None = None
        self.sync_s = 0.0  # logged with the step whose rollout came from that sync's weights
        self.metrics: dict[str, Any] = {}
        self._last_save = time.monotonic()  # checkpoint.every_minutes counts from here

    @classmethod
    def open(cls, cfg: UnirlConfig, *, resume: bool, overwrite: bool) -> _Job:
        """Check the directories, the paths and a checkpoint to resume from before any work,
        then build the rollout source, the evaluator and the backend."""
        from unirl.rollouts import build_rollout_source  # needs transformers for the sampler
        from unirl.rollouts.eval.evaluator import build_evaluator
        from unirl.rollouts.postprocess import load_postprocess_hook

        run_dir, ckpt_root = Path(cfg.logging.run_dir), _checkpoint_root(cfg)
        # Before any work: the directories can be written, and they hold no other run.
        run_dirs.check_writable(run_dir, "logging.run_dir")
        run_dirs.check_writable(
            ckpt_root, "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir"
        )
        check_local_paths(cfg)
        # what `unirl check` decides and refuses for the staleness the config allows (reuse
        # under async generation): refused here too, before any work, not at the first stale step
        decide_old_logprobs(cfg, staleness=configured_staleness(cfg))
        resumed_id = run_dirs.claim(run_dir, ckpt_root, resume=resume, overwrite=overwrite)
        found = checkpointing.latest_complete(ckpt_root) if resume else None
        if found is not None:
            check_resume_fits(found[1], cfg, run_id=resumed_id)
        source = build_rollout_source(cfg)
        hook = load_postprocess_hook(cfg)
        # the eval section's prompts, read and checked before the backend is built; its reward
        # workers, if any, start at its first run
        evaluator = build_evaluator(cfg, source)
        total = _rl_steps(cfg, source)
        backend = build_backend(
            cfg,
            # the policy's steps (its LR schedule); the critic adds its warm-up steps
            total_optimizer_steps=policy_rl_steps(cfg, total)
            * cfg.layout.optimizer_steps_per_rollout,
            needs_reference=needs_reference(cfg),
        )
        job = cls(
            cfg, source=source, backend=backend, total=total, resume=resume, overwrite=overwrite
        )
        job.resumed_id, job.found, job.hook, job.evaluator = resumed_id, found, hook, evaluator
        return job

    def start(self) -> None:
        """Claim the run directory (one run id on every rank), resume from the checkpoint, open
        the metrics log and hand the source the weights the run starts from."""
        from unirl.rollouts.async_source import generating_ahead, restore

        cfg = self.cfg
        self.run_id = _same_on_every_rank(self.resumed_id or run_dirs.new_run_id())
        if _is_rank0():
            if self.overwrite:
                run_dirs.clear_previous_run(self.run_dir, self.ckpt_root)
            run_dirs.write_run_id(self.run_dir, self.run_id)
        _barrier()
        # rollouts generated ahead in a worker, if the config asks (rollouts/async_source)
        self.source = generating_ahead(self.source, cfg)
        client = None
        if self.found is not None:
            self.resumed_from, path = self.found
            client = self.backend.load_checkpoint(path)
            self.start_step = int(client["rl_step"])
            restore(self.source, client["rollout_source"])
        if self.resume and self.topo.is_reporting_rank:
            if self.found is None:
                logger.info(
                    "--resume: no complete checkpoint in %s, starting fresh", self.ckpt_root
                )
            else:
                logger.info("resumed from %s (RL step %d)", self.found[1], self.start_step)
        if self.topo.is_reporting_rank:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self.found is None:  # a resumed run's config replaces the old one after a step
                self._write_config()
            self.metrics_log = _metrics_log(cfg, self.run_dir, self.start_step, self.run_id)
            if cfg.logging.completions_every:
                self.completions = CompletionsLog(
                    self.run_dir,
                    every=cfg.logging.completions_every,
                    count=cfg.logging.completions_per_step,
                    resume_from_step=self.start_step,
                )
        self.version = _initial_policy_version(cfg, client)
        self.sync = WeightSync(cfg, self.backend, self.source)
        self.sync_s = self.sync.initial(self.version)

    def loop(self) -> None:
        """The RL steps, from the first this run has not done to ``total``."""
        cfg, topo = self.cfg, self.topo
        rl_step = RLStep(cfg, self.backend)
        if topo.is_reporting_rank and self.backend.critic is not None:
            logger.info("critic: %s", critic_summary(cfg))
        guard = DivergenceGuard(cfg.train.max_consecutive_skipped_steps)
        bars = progress_enabled(cfg.progress.enabled)
        every = cfg.progress.log_every
        with RunProgress(
            self.total, topo, bars, initial=self.start_step, show=RUN_BAR_KEYS, log_every=every
        ) as bar:
            for k in range(self.start_step, self.total):
                self._step(k, rl_step, guard, bars)
                self._after_step(k + 1, bar)
                bar.advance(self.metrics)

    def _rollout(self, k: int, bars: bool) -> RolloutBatch:
        """Rollout k from the source, under a generation bar when the source generates
        (reading finished rollouts, from a file, is no phase worth a bar)."""
        cfg = self.cfg
        if not SOURCES.get(cfg.rollout.source).generates:
            return self.source.next_rollout(k)
        log_summary = logs_step(k + 1, cfg.progress.log_every, self.total)
        with GenerationProgress(
            "generate", cfg.layout.rollout_samples, self.topo, enabled=bars, log_summary=log_summary
        ) as gen_bar:
            return self.source.next_rollout(k, progress=gen_bar)

    def _step(self, k: int, rl_step: RLStep, guard: DivergenceGuard, bars: bool) -> None:
        """RL step k: the rollout, the core step, its metrics, after the run's first step the
        source's fit check (`ChecksTrainerFit`, before the sync can wake a sleeping engine),
        then the weights checked and synced to the source (the non-finite check comes before
        any sync, save or export)."""
        from unirl.rollouts.postprocess import apply_postprocess_hook
        from unirl.rollouts.source import (
            ChecksTrainerFit,
            MeasuresRollouts,
            policy_version_metrics,
        )

        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self._rollout(k, bars)
        generation_s = time.perf_counter() - t0
        source_metrics = (
            self.source.rollout_metrics() if isinstance(self.source, MeasuresRollouts) else {}
        )
        if self.hook is not None:
            hook_name = str(cfg.algorithm.rollout_postprocess_hook)
            batch = apply_postprocess_hook(
                self.hook,
                batch,
                k,
                hook_name,
                timeout_s=cfg.algorithm.rollout_postprocess_timeout_s,
            )
        result = rl_step.run(batch, rl_step=k, policy_version=self.version)
        self.metrics = (
            result.metrics
            | policy_version_metrics(batch, self.version)
            | {
                "old_logprobs/source": result.decision.source,
                "time/generation_s": generation_s,
                "time/weight_sync_s": self.sync_s,
                # what that sync carried: the full weights, or under model.lora the adapter
                "weight_sync/bytes": float(self.sync.last_bytes if self.sync else 0),
            }
            | source_metrics
        )
        self.version += int(result.metrics["optimizer_steps"])
        if self.metrics_log is not None:
            self.metrics_log.write(k + 1, self.metrics)
        if self.completions is not None:
            self.completions.write(k + 1, batch, self.metrics_log)
        if k == self.start_step and isinstance(self.source, ChecksTrainerFit):
            # the trainer's real peak exists now (gradients, optimizer state): does the engine
            # beside it still fit, before the sync below wakes it (rollout.vllm.sleep)
            self.source.check_trainer_fit()
        assert self.sync is not None, "start() comes before loop()"
        self.sync_s = self.sync.after_step(k + 1, self.metrics, guard, self.version)

    def _write_config(self) -> None:
        (self.run_dir / "config.yaml").write_text(
            yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
        )

    def _after_step(self, done: int, bar: RunProgress) -> None:
        """The eval and the checkpoint due after ``done`` RL steps, kept out of the ETA (neither
        is a step). A resumed run's config.yaml is written after its first step: a resume that
        fails before it leaves the run's own config in place."""
        cfg = self.cfg
        if self.found is not None and done == self.start_step + 1 and self.topo.is_reporting_rank:
            self._write_config()
        if self.evaluator is not None and self.evaluator.due(done, self.total):
            with bar.excluded():
                eval_metrics = self.evaluator.run(done)
            if self.metrics_log is not None:
                self.metrics_log.write(done, eval_metrics)
        if self._checkpoint_due(done):
            with bar.excluded():
                _save(
                    self.backend, self.ckpt_root, done, self.version, cfg, self.source,
                    self.run_id, self.topo.is_reporting_rank,
                )  # fmt: skip

    def _checkpoint_due(self, done: int) -> bool:
        """After the last step, every ``checkpoint.every`` steps, or once
        ``checkpoint.every_minutes`` passed since the last save (or the start), by rank 0's
        clock: its decision is broadcast, so every rank saves at the same step."""
        ckpt = self.cfg.checkpoint
        if done == self.total or (ckpt.every and done % ckpt.every == 0):
            self._last_save = time.monotonic()
            return True
        if not ckpt.every_minutes:
            return False
        due = _same_on_every_rank(
            str(time.monotonic() - self._last_save >= ckpt.every_minutes * 60.0)
        )
        if due == "True":
            self._last_save = time.monotonic()
        return due == "True"

    def finish(self) -> RunSummary:
        """Export the policy (and critic) in Hugging Face layout; close the metrics log."""
        # under model.lora the run's export is the adapter (a PEFT folder), never a merged model
        name = "hf" if self.cfg.model.lora is None else "adapter"
        export = self.run_dir / name if self.cfg.checkpoint.export_hf else None
        if export is not None:
            self._export(export)
        if self.metrics_log is not None:
            self.metrics_log.close()
        if self.completions is not None:
            self.completions.close()
        return RunSummary(
            run_dir=self.run_dir,
            steps_done=self.total,
            resumed_from=self.resumed_from,
            last_metrics={k: v for k, v in self.metrics.items() if isinstance(v, float)},
            hf_export=export,
            reporting=self.topo.is_reporting_rank,
        )

    def _export(self, export: Path) -> None:
        from unirl.rollouts.build import save_run_tokenizer

        reporting = self.topo.is_reporting_rank
        if self.cfg.model.lora is not None:
            # the adapter as a PEFT folder; `unirl convert --merge-adapter` makes a full model
            if not isinstance(self.backend, TrainsAdapter):
                raise RuntimeError(f"model.lora: backend {self.cfg.backend} trains no adapter")
            self.backend.export_adapter(export)
            what = "LoRA adapter exported as a PEFT folder"
        else:
            self.backend.export_hf(export)
            what = "policy exported in Hugging Face layout"
        if _is_rank0():  # the tokenizer the rollouts used, for AutoTokenizer and engines
            save_run_tokenizer(self.cfg, export)
        _barrier()
        if reporting:
            logger.info("%s to %s", what, export)
        if self.backend.critic is not None:
            self.backend.critic.export_hf(self.run_dir / "hf_critic")
            _barrier()
            if reporting:
                logger.info(
                    "critic exported in Hugging Face layout to %s", self.run_dir / "hf_critic"
                )

    def close(self, *, backend: bool) -> None:
        """Release the evaluator and the source (an engine's processes go also when the run
        failed), then the backend unless a collective timed out (its group cannot be torn
        down)."""
        if self.evaluator is not None:
            self.evaluator.close()
        self.source.close()
        if backend:
            self.backend.close()


def _checkpoint_root(cfg: UnirlConfig) -> Path:
    return (
        Path(cfg.checkpoint.dir)
        if cfg.checkpoint.dir
        else Path(cfg.logging.run_dir) / "checkpoints"
    )


def _rl_steps(cfg: UnirlConfig, source: RolloutSource) -> int:
    """The RL steps this run takes: ``train.rl_steps``, or fewer if a rollout file holds fewer;
    the policy must get at least one after the critic's warm-up."""
    total = cfg.train.rl_steps
    if source.num_rollouts is not None and source.num_rollouts < total:
        logger.info(
            "the rollout file holds %d rollouts: running %d RL steps (train.rl_steps=%d)",
            source.num_rollouts, source.num_rollouts, total,
        )  # fmt: skip
        total = source.num_rollouts
    if policy_rl_steps(cfg, total) < 1:
        raise ConfigError(
            f"critic.warmup_steps={cfg.critic.warmup_steps} leaves the policy no RL step of the "
            f"{total} this run takes (the rollout file's length); lower critic.warmup_steps"
        )
    return total


def _metrics_log(cfg: UnirlConfig, run_dir: Path, start: int, run_id: str) -> MetricsLog:
    """The reporting rank's metrics log (JSONL, TensorBoard, W&B as configured)."""
    wandb = (
        None
        if cfg.logging.wandb is None
        else WandbLog(cfg.logging.wandb, run_dir, run_id=run_id, config=cfg.to_dict())
    )
    return MetricsLog(
        run_dir, tensorboard=cfg.logging.tensorboard, resume_from_step=start, wandb=wandb
    )


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
