"""One RL step on a batch of rollouts, driving any `TrainingBackend`.

    validate -> decide old log-probs -> plan -> [forward-only passes] -> advantages
             -> for each optimizer step: forward_backward + optimizer_step -> metrics

Every rank holds the whole rollout batch (it is small next to the model) and plans from it
identically, so the plan, the global counts and the advantages need no communication; only the
forward-only log-probs, computed for this rank's share, are summed over the data-parallel group
(each sample lives on exactly one data-parallel rank) after context-parallel pieces are gathered.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.core.backend import ModelRole, RecordsRouting, TrainingBackend
from unirl.core.config.derived import (
    advantage_settings,
    forward_logprob_spec,
    loss_settings,
    needs_reference,
    routing_replay,
    train_logprob_spec,
)
from unirl.core.config.model_shape import hf_config_fields, moe_shape
from unirl.core.config.routing_replay import replay_shape
from unirl.core.config.run_config import UnirlConfig, norm_length
from unirl.core.critic import critic_warming_up, value_metrics
from unirl.core.data.context_parallel import gather_from_cp
from unirl.core.data.counts import GlobalCounts
from unirl.core.data.microbatch import TrainMicrobatch, build_microbatch
from unirl.core.data.plan import MicrobatchPlan
from unirl.core.data.rollout import PackedMicrobatch, PaddedResponses, RolloutBatch
from unirl.core.data.routed_experts import recorded_per_sample
from unirl.core.data.truncation import mask_truncated
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.maths.advantages import (
    AdvantageInputs,
    AdvantageOutput,
    compute_advantages,
    rewards_for_estimator,
)
from unirl.core.maths.losses import LossInputs, Metric, compute_loss, critic_loss, reduce_metrics
from unirl.core.mismatch import mismatch_by_staleness
from unirl.core.moe_loss import LossWithRouterTerm, RouterLossSettings
from unirl.core.old_logprobs import (
    DecisionLog,
    OldLogprobDecision,
    decide_old_logprobs,
    rollout_staleness,
    uncorrected_staleness,
)
from unirl.core.progress.bars import MicrobatchProgress, logs_step, progress_enabled

logger = logging.getLogger(__name__)

# A forward-only pass: (microbatches, progress bar) -> per-microbatch [T] tensors.
_ForwardPass = Callable[[Sequence[TrainMicrobatch], MicrobatchProgress], list[torch.Tensor]]


@attrs.frozen(kw_only=True)
class StepResult:
    metrics: dict[str, float]
    decision: OldLogprobDecision


@attrs.frozen(kw_only=True)
class _Passes:
    """What the forward-only phase hands on: the rollout (with recorded experts under R2), its
    padded responses, and the old, reference and value ``[B, L]`` tensors (None: not used)."""

    batch: RolloutBatch
    padded: PaddedResponses
    old_bl: torch.Tensor | None
    ref_bl: torch.Tensor | None
    values_bl: torch.Tensor | None


class RLStep:
    """Runs RL steps for one run: built once (settings, decision log), called per rollout."""

    def __init__(self, cfg: UnirlConfig, backend: TrainingBackend) -> None:
        self.cfg = cfg
        self.backend = backend
        self.topology = backend.topology
        # decoupled PPO as for on-policy data; run() sets it per rollout (algorithm.decoupled)
        self.loss_settings = loss_settings(cfg)
        self.advantage_settings = advantage_settings(cfg)
        self.uses_reference = needs_reference(cfg)
        # R3 (routing_replay: rollout): every forward replays the rollout's routed_experts, which
        # each rollout must carry, in the model's shape. Otherwise experts in the data are not
        # replayed (under R2 the old-log-prob forward records its own).
        # (decided once, `routing_replay`; the backends read it from the passes' specs)
        routing = routing_replay(cfg)
        self.rollout_experts = replay_shape(cfg) if routing == "replay" else None
        # R2 (routing_replay: record): the old-log-prob forward records, the training replays.
        self.records_routing = routing == "record"
        # A mixture-of-experts policy: the router's auxiliary losses join the loss.
        # (a model whose config cannot be read here is the backend's to report: no router term)
        shape = moe_shape(cfg.model) if hf_config_fields(cfg.model) is not None else None
        self.router_settings = None if shape is None else RouterLossSettings.from_config(cfg, shape)
        self.decisions = DecisionLog()
        self._warned_stale = False  # the uncorrected-staleness warning, once per run
        self.show_bars = progress_enabled(cfg.progress.enabled)
        self.log_phases = True  # with bars off: this step's phase lines at INFO (log_every)
        # PPO's value model, when the config enables one (`unirl.core.critic`).
        self.critic = backend.critic

    # -- public -------------------------------------------------------------------------

    def run(
        self, batch: RolloutBatch, *, rl_step: int = 0, policy_version: int | None = None
    ) -> StepResult:
        """One RL step on ``batch``. ``policy_version`` (the optimizer steps the policy has
        taken) tells the decision how stale the samples are; None: treat them as on-policy."""
        t_start = time.perf_counter()
        self.log_phases = logs_step(
            rl_step + 1, self.cfg.progress.log_every, self.cfg.train.rl_steps
        )
        decision, staleness = self._decide(batch, policy_version)
        cut = None
        if self.cfg.algorithm.mask_truncated:
            # after validation (a rollout cut everywhere trains nothing, but is no bad data),
            # before planning: the step's token and sequence counts leave the cut samples out
            batch, cut = mask_truncated(batch)
        plans = self._plans(batch, rl_step)
        critic_plans = (
            self._plans(batch, rl_step, micro_batch_size=self.cfg.critic.micro_batch_size)
            if self.critic is not None and self.cfg.critic.micro_batch_size is not None
            else plans
        )
        warming_up = self.critic is not None and critic_warming_up(self.cfg, rl_step)
        timings: dict[str, float] = {}
        passes = self._forward_passes(batch, decision, plans, critic_plans, timings)
        batch = passes.batch  # with the experts the old-log-prob forward recorded (R2)
        adv, response_mask = self._advantages(passes, timings)
        t0 = time.perf_counter()
        step_metrics = [] if warming_up else self._policy_steps(passes, plans, adv, decision)
        timings["time/train_s"] = time.perf_counter() - t0
        critic_metrics = self._critic_steps(passes, critic_plans, adv, timings)
        timings["time/step_s"] = time.perf_counter() - t_start
        metrics = self._metrics(passes, adv, response_mask, step_metrics, critic_metrics)
        if self.critic is not None:
            metrics["critic/warmup"] = float(warming_up)
        metrics.update(_batch_metrics(batch))
        if cut is not None:
            metrics["rollout/truncated_masked_fraction"] = cut / max(len(batch), 1)
        metrics.update(
            self._mismatch_by_staleness(
                batch, decision, policy_version, staleness, passes.old_bl, response_mask, metrics
            )
        )
        metrics.update(timings)
        tokens = int(batch.lengths.sum()) * self.cfg.batch.epochs_per_rollout
        metrics["throughput/train_tokens_per_s"] = tokens / max(timings["time/train_s"], 1e-9)
        metrics["optimizer_steps"] = float(len(step_metrics))  # the policy's
        metrics["old_logprobs/recompute"] = float(decision.source == "recompute")
        return StepResult(metrics=metrics, decision=decision)

    # -- the phases -----------------------------------------------------------------------

    def _decide(
        self, batch: RolloutBatch, policy_version: int | None
    ) -> tuple[OldLogprobDecision, int]:
        """Validate the rollout, then decide where the old log-probs come from (and whether
        decoupled PPO is on) for it; returns the decision and the rollout's staleness."""
        cfg = self.cfg
        batch.validate(
            vocab_size=self.backend.vocab_size,
            max_seq_len=cfg.model.max_seq_len,
            samples_per_prompt=cfg.batch.samples_per_prompt,
            moe=self.rollout_experts,
        )
        staleness = rollout_staleness(batch, policy_version)
        has_behaviour = batch.has("rollout_logprobs")
        decision = decide_old_logprobs(
            cfg, len(batch), staleness=staleness, has_behaviour=has_behaviour
        )
        # algorithm.decoupled: auto is decided per rollout, with the proximal source
        self.loss_settings = attrs.evolve(self.loss_settings, decoupled=decision.decoupled.on)
        if self.topology.is_reporting_rank:
            self.decisions.update(decision)
            warning = uncorrected_staleness(cfg, staleness, has_behaviour=has_behaviour)
            if warning is not None and not self._warned_stale:
                logger.warning("%s", warning)
                self._warned_stale = True
        self._check_data_for(decision, batch)
        return decision, staleness

    def _forward_passes(
        self,
        batch: RolloutBatch,
        decision: OldLogprobDecision,
        plans: Sequence[MicrobatchPlan],
        critic_plans: Sequence[MicrobatchPlan],
        timings: dict[str, float],
    ) -> _Passes:
        """The forward-only passes over this rank's share (the first epoch's microbatches):
        old log-probs when recomputed, reference log-probs when the rollout lacks them, the
        critic's values; what the rollout carries stands in for the rest."""
        topo = self.topology
        needs_ref_forward = self.uses_reference and not batch.has("ref_logprobs")
        first = (
            [batch.pack(idx) for step in plans[0].steps for idx in step.microbatches(topo.dp_rank)]
            if decision.source == "recompute" or needs_ref_forward
            else []
        )
        old_bl = ref_bl = None
        if decision.source == "recompute":
            t0 = time.perf_counter()
            old_bl = self._forward_to_responses(
                batch, first, self._logprobs_of("policy"), "actor forward"
            )
            if self.records_routing:
                batch = batch.with_routed_experts(self._recorded_routing(first))
            timings["time/actor_forward_s"] = time.perf_counter() - t0
        if needs_ref_forward:
            t0 = time.perf_counter()
            ref_bl = self._forward_to_responses(
                batch, first, self._logprobs_of("reference"), "ref forward"
            )
            timings["time/ref_forward_s"] = time.perf_counter() - t0
        padded = batch.padded_responses()
        if ref_bl is None and padded.ref_logprobs is not None:
            ref_bl = padded.ref_logprobs
        if decision.source == "rollout":
            old_bl = padded.rollout_logprobs
        values_bl = padded.values
        if self.critic is not None:
            t0 = time.perf_counter()
            values_bl = self._critic_values(batch, critic_plans)
            timings["time/critic_forward_s"] = time.perf_counter() - t0
        return _Passes(
            batch=batch, padded=padded, old_bl=old_bl, ref_bl=ref_bl, values_bl=values_bl
        )

    def _critic_values(
        self, batch: RolloutBatch, critic_plans: Sequence[MicrobatchPlan]
    ) -> torch.Tensor:
        """The critic's values of every response token, from its own first-epoch plan."""
        critic, topo = self.critic, self.topology
        assert critic is not None
        packs = [
            batch.pack(i) for step in critic_plans[0].steps for i in step.microbatches(topo.dp_rank)
        ]
        return self._forward_to_responses(
            batch,
            packs,
            lambda mbs, bar: critic.forward_values(mbs, progress=bar),
            "critic forward",
        )

    def _advantages(
        self, passes: _Passes, timings: dict[str, float]
    ) -> tuple[AdvantageOutput, torch.Tensor]:
        """The advantages (and returns) of the rollout, and its response mask."""
        t0 = time.perf_counter()
        batch, padded = passes.batch, passes.padded
        response_mask = padded.loss_mask.to(torch.float32) * padded.mask
        rewards, token_rewards = rewards_for_estimator(
            batch.rewards.to(torch.float32),
            padded.token_rewards,
            self.advantage_settings.estimator,
        )
        adv = compute_advantages(
            AdvantageInputs(
                rewards=rewards,
                group_ids=batch.group_ids,
                response_mask=response_mask,
                token_rewards=token_rewards,
                old_logprobs=passes.old_bl,
                ref_logprobs=passes.ref_bl,
                values=passes.values_bl,
                teacher_logprobs=passes.ref_bl
                if self.cfg.algorithm.distillation_coef > 0
                else None,
            ),
            self.advantage_settings,
        )
        timings["time/advantages_s"] = time.perf_counter() - t0
        return adv, response_mask

    def _policy_steps(
        self,
        passes: _Passes,
        plans: Sequence[MicrobatchPlan],
        adv: AdvantageOutput,
        decision: OldLogprobDecision,
    ) -> list[dict[str, float]]:
        """The policy's optimizer steps, every epoch's; their metrics, step by step."""
        compare = _compares_rollout(decision)
        return [
            self._optimizer_step(
                passes.batch, step, adv.advantages, passes.old_bl, passes.ref_bl, compare
            )
            for plan in plans
            for step in plan.steps
        ]

    def _critic_steps(
        self,
        passes: _Passes,
        critic_plans: Sequence[MicrobatchPlan],
        adv: AdvantageOutput,
        timings: dict[str, float],
    ) -> list[dict[str, float]]:
        """The critic's optimizer steps (none without a critic); their metrics, step by step."""
        if self.critic is None:
            return []
        values_bl = passes.values_bl
        assert values_bl is not None
        t0 = time.perf_counter()
        out = [
            self._critic_step(passes.batch, step, adv.returns, values_bl)
            for plan in critic_plans
            for step in plan.steps
        ]
        timings["time/critic_train_s"] = time.perf_counter() - t0
        return out

    def _metrics(
        self,
        passes: _Passes,
        adv: AdvantageOutput,
        response_mask: torch.Tensor,
        step_metrics: Sequence[Mapping[str, float]],
        critic_metrics: Sequence[Mapping[str, float]],
    ) -> dict[str, float]:
        """The policy's metrics averaged over its optimizer steps; the critic's, prefixed."""
        metrics = _mean_over_steps(step_metrics)
        if self.critic is not None:
            assert passes.values_bl is not None
            metrics.update({f"critic/{k}": v for k, v in _mean_over_steps(critic_metrics).items()})
            metrics.update(value_metrics(passes.values_bl, adv.returns, response_mask))
        return metrics

    # -- pieces ---------------------------------------------------------------------------

    def _mismatch_by_staleness(
        self,
        batch: RolloutBatch,
        decision: OldLogprobDecision,
        policy_version: int | None,
        staleness: int,
        old_bl: torch.Tensor | None,
        response_mask: torch.Tensor,
        metrics: Mapping[str, float],
    ) -> dict[str, float]:
        """The train/rollout mismatch split by staleness (`unirl.core.mismatch`), logged by an
        async run (``train.max_staleness > 0``) or for a stale rollout; empty otherwise, and
        wherever the mismatch itself is not measured."""
        if (
            policy_version is None
            or not (self.cfg.train.max_staleness or staleness > 0)
            or not _compares_rollout(decision)
            or not batch.has("rollout_logprobs")
            or not self.topology.is_last_pipeline_stage()  # old_bl holds zeros elsewhere
        ):
            return {}
        ages = [
            None if s.policy_version is None else policy_version - s.policy_version
            for s in batch.samples
        ]
        if old_bl is not None:  # the proximal log-probs of the whole rollout
            behaviour_bl = batch.padded_responses().rollout_logprobs
            assert behaviour_bl is not None
            return mismatch_by_staleness(old_bl, behaviour_bl, response_mask, ages)
        # reuse: the loss measured the proximal (training forward's) log-probs on every token,
        # and the staleness need allows reuse only when no sample is stale
        if any(a != 0 for a in ages) or "train_rollout_logprob_abs_diff" not in metrics:
            return {}
        return {
            "mismatch/staleness_0/tokens": float(response_mask.sum()),
            "mismatch/staleness_0/abs_diff": metrics["train_rollout_logprob_abs_diff"],
            "mismatch/staleness_0/kl": metrics["train_rollout_kl"],
        }

    def _check_data_for(self, decision: OldLogprobDecision, batch: RolloutBatch) -> None:
        users = []
        if decision.source == "rollout":
            users.append("old_logprobs: rollout")
        if self.loss_settings.rollout_correction != "none":
            users.append(
                f"algorithm.rollout_correction.mode: {self.loss_settings.rollout_correction}"
            )
        if self.cfg.algorithm.mismatch_metrics:
            users.append("algorithm.mismatch_metrics: true")
        if decision.decoupled.on:
            users.append(f"decoupled PPO ({decision.decoupled.reason}; the behaviour log-probs)")
        if users and not batch.has("rollout_logprobs"):
            raise RolloutDataError(
                f"the rollout has no 'rollout_logprobs', but {', '.join(users)} needs them; give "
                "the rollout engine's per-token log-probs for every sample, or change those settings"
            )

    def _plans(
        self, batch: RolloutBatch, rl_step: int, *, micro_batch_size: int | None = None
    ) -> list[MicrobatchPlan]:
        """The policy's plans, one per epoch; with ``micro_batch_size`` (the critic's own), the
        same optimizer steps cut into microbatches of that many samples."""
        cfg, b = self.cfg, self.cfg.batch
        if len(batch) % b.samples_per_optimizer_step:
            raise RolloutDataError(
                f"the rollout has {len(batch)} samples, not a multiple of "
                f"batch.samples_per_optimizer_step={b.samples_per_optimizer_step}; send whole "
                "optimizer steps (or change batch.samples_per_optimizer_step)"
            )
        plans = []
        for epoch in range(b.epochs_per_rollout):
            plans.append(
                MicrobatchPlan.build(
                    batch.lengths.tolist(),
                    batch.valid_token_counts.tolist(),
                    num_optimizer_steps=len(batch) // b.samples_per_optimizer_step,
                    dp_size=self.topology.dp_size,
                    micro_batch_size=micro_batch_size or b.micro_batch_size,
                    max_tokens_per_microbatch=None
                    if micro_batch_size
                    else b.max_tokens_per_microbatch,
                    norm_length=norm_length(cfg),
                    # later epochs see the groups in a new order (same on every rank)
                    shuffle_seed=None
                    if epoch == 0
                    else (cfg.train.seed * 1_000_003 + rl_step) * 101 + epoch,
                    group_ids=batch.group_ids.tolist(),
                )
            )
        return plans

    def _microbatch(
        self,
        packed: PackedMicrobatch,
        advantages_bl: torch.Tensor | None,
        old_bl: torch.Tensor | None,
        ref_bl: torch.Tensor | None,
        *,
        returns_bl: torch.Tensor | None = None,
        old_values_bl: torch.Tensor | None = None,
        keep_experts: bool = False,
    ) -> TrainMicrobatch:
        """``keep_experts``: hand the policy the samples' ``routed_experts`` to replay (R3: the
        rollout's, every policy pass; R2: the recorded ones, the training passes); otherwise
        experts in the data are dropped."""
        topo = self.topology
        if not keep_experts and packed.routed_experts is not None:
            packed = attrs.evolve(packed, routed_experts=None)

        def place(values: torch.Tensor | None) -> torch.Tensor | None:
            if values is None or packed.num_tokens == 0:
                return None if values is None else torch.zeros(0)
            return packed.place_responses(values.to(torch.float32).cpu())

        return build_microbatch(
            packed,
            advantages=place(advantages_bl),
            old_logprobs=place(old_bl),
            ref_logprobs=place(ref_bl),
            returns=place(returns_bl),
            old_values=place(old_values_bl),
            cp_size=topo.cp_size,
            cp_rank=topo.cp_rank,
            cp_group=topo.groups.cp,
        )

    def _logprobs_of(self, role: ModelRole) -> _ForwardPass:
        # run() validated every token id against this vocabulary before any forward
        spec = forward_logprob_spec(self.cfg, self.backend.vocab_size, targets_checked=True)
        if role != "policy":  # the reference routes freely
            spec = attrs.evolve(spec, routing="off")
        return lambda mbs, bar: self.backend.forward_logprobs(
            mbs, role=role, spec=spec, progress=bar
        )

    def _forward_to_responses(
        self,
        batch: RolloutBatch,
        packs: Sequence[PackedMicrobatch],
        forward: _ForwardPass,
        phase: str,
    ) -> torch.Tensor:
        """A forward-only per-token quantity (log-probs, values) of every response token, as a
        batch ``[B, L]`` tensor."""
        topo = self.topology
        replay = self.rollout_experts is not None
        mbs = [self._microbatch(p, None, None, None, keep_experts=replay) for p in packs]
        with MicrobatchProgress(
            phase, len(mbs), topo, enabled=self.show_bars, log_summary=self.log_phases
        ) as bar:
            results = forward(mbs, bar)
        width = int(batch.response_lengths.max())
        out = torch.zeros(len(batch), width, dtype=torch.float32)
        for packed, logp in zip(packs, results):  # empty on non-last pipeline stages
            logp = logp.detach().float()
            if topo.cp_size > 1:
                logp = gather_from_cp(logp, packed.cu_seqlens, topo.groups.cp)
            logp = logp.cpu()
            if packed.num_tokens == 0:
                continue
            for sample, values in zip(packed.sample_indices, packed.responses_from_logits(logp)):
                out[sample, : values.numel()] = values
        group = topo.groups.dp
        if group is not None and topo.dp_size > 1:
            reduced = out.to(self.backend.device)
            dist.all_reduce(reduced, group=group)  # each sample lives on exactly one dp rank
            out = reduced.cpu()
        return out

    def _recorded_routing(self, packs: Sequence[PackedMicrobatch]) -> dict[int, torch.Tensor]:
        """R2: the experts the policy's forward-only pass over ``packs`` (this rank's) recorded,
        per sample index of the whole batch (CP pieces gathered, every DP rank's collected)."""
        backend, topo = self.backend, self.topology
        if not isinstance(backend, RecordsRouting):
            raise ConfigError(
                f"algorithm.routing_replay='record': {type(backend).__name__} does not hand "
                "back recorded routing; set algorithm.routing_replay: off"
            )
        recorded = backend.recorded_routing()
        if topo.cp_size > 1:
            recorded = [
                gather_from_cp(e.to(backend.device), p.cu_seqlens, topo.groups.cp)
                for p, e in zip(packs, recorded, strict=True)
            ]
        mine = recorded_per_sample(packs, [e.cpu() for e in recorded])
        group = topo.groups.dp
        if group is None or topo.dp_size == 1:
            return mine
        gathered: list[Any] = [None] * topo.dp_size
        dist.all_gather_object(gathered, mine, group=group)
        return {i: e for part in gathered for i, e in part.items()}

    def _optimizer_step(
        self,
        batch: RolloutBatch,
        step: Any,
        advantages_bl: torch.Tensor,
        old_bl: torch.Tensor | None,
        ref_bl: torch.Tensor | None,
        compare_rollout: bool,
    ) -> dict[str, float]:
        """``compare_rollout``: hand the loss the rollout's log-probs (for the train/rollout
        mismatch metrics and rollout correction); off when the old log-probs are those."""
        topo, settings = self.topology, self.loss_settings
        counts: GlobalCounts = step.counts
        packs = [batch.pack(idx) for idx in step.microbatches(topo.dp_rank)]
        replay = self.rollout_experts is not None or self.records_routing
        mbs = [
            self._microbatch(p, advantages_bl, old_bl, ref_bl, keep_experts=replay) for p in packs
        ]

        def policy_loss(
            mb: TrainMicrobatch, logprobs: torch.Tensor, entropy: torch.Tensor | None
        ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
            device = logprobs.device

            def dev(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else t.to(device, non_blocking=True)

            out = compute_loss(
                LossInputs(
                    logprobs=logprobs,
                    old_logprobs=dev(mb.old_logprobs),
                    rollout_logprobs=dev(mb.rollout_logprobs) if compare_rollout else None,
                    ref_logprobs=dev(mb.ref_logprobs),
                    advantages=dev(mb.advantages),
                    loss_mask=dev(mb.loss_mask),
                    seq_ids=dev(mb.seq_ids),
                    num_seqs=mb.num_seqs,
                    seq_token_counts=dev(mb.seq_token_counts),
                    entropy=entropy,
                    cp_group=mb.cp_group,
                ),
                counts,
                settings,
                validate=False,  # the batch was validated once, before anything ran
            )
            return out.loss, out.metrics

        # an MoE policy's router term joins the loss (this step's coefficients)
        loss_fn = LossWithRouterTerm(
            policy=policy_loss, router=self.router_settings, global_tokens=sum(step.rank_tokens)
        )
        spec = train_logprob_spec(self.cfg, self.backend.vocab_size, targets_checked=True)
        with MicrobatchProgress(
            "actor train", len(mbs), topo, enabled=self.show_bars, log_summary=self.log_phases
        ) as bar:
            per_mb = self.backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
        stats = self.backend.optimizer_step()
        metrics: dict[str, float] = {}
        if topo.is_last_pipeline_stage():
            metrics = reduce_metrics(per_mb, group=topo.groups.dp_cp)
        if topo.pp_size > 1:
            metrics = _from_last_stage(metrics, topo.groups.pp, topo.pp_size)
        metrics["grad_norm"] = stats.grad_norm
        metrics["lr"] = stats.lr
        metrics["skipped_steps"] = float(stats.skipped)
        return metrics

    def _critic_step(
        self, batch: RolloutBatch, step: Any, returns_bl: torch.Tensor, values_bl: torch.Tensor
    ) -> dict[str, float]:
        """One optimizer step of the critic on the returns, clipped around the pre-step values."""
        assert self.critic is not None
        topo, settings = self.topology, self.loss_settings
        counts: GlobalCounts = step.counts
        packs = [batch.pack(idx) for idx in step.microbatches(topo.dp_rank)]
        mbs = [
            self._microbatch(p, None, None, None, returns_bl=returns_bl, old_values_bl=values_bl)
            for p in packs
        ]

        def loss_fn(
            mb: TrainMicrobatch, values: torch.Tensor
        ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
            device = values.device
            assert mb.returns is not None
            out = critic_loss(
                values,
                mb.returns.to(device),
                None if mb.old_values is None else mb.old_values.to(device),
                loss_mask=mb.loss_mask.to(device),
                seq_ids=mb.seq_ids.to(device),
                num_seqs=mb.num_seqs,
                seq_token_counts=mb.seq_token_counts.to(device),
                counts=counts,
                settings=settings,
            )
            return out.loss, out.metrics

        with MicrobatchProgress(
            "critic train", len(mbs), topo, enabled=self.show_bars, log_summary=self.log_phases
        ) as bar:
            per_mb = self.critic.forward_backward(mbs, loss_fn=loss_fn, progress=bar)
        stats = self.critic.optimizer_step()
        metrics: dict[str, float] = {}
        if topo.is_last_pipeline_stage():
            metrics = reduce_metrics(per_mb, group=topo.groups.dp_cp)
        if topo.pp_size > 1:
            metrics = _from_last_stage(metrics, topo.groups.pp, topo.pp_size)
        metrics.pop("values_mean", None)  # the pre-step mean over the rollout is reported
        metrics["grad_norm"] = stats.grad_norm
        metrics["lr"] = stats.lr
        metrics["skipped_steps"] = float(stats.skipped)
        return metrics


def _from_last_stage(metrics: dict[str, float], pp_group: Any, pp_size: int) -> dict[str, float]:
    """The loss lives on the last pipeline stage: give every stage its metrics (one small object
    broadcast per optimizer step), so any rank can log and the run's metrics agree everywhere."""
    box = [metrics]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, pp_size - 1), group=pp_group)
    return box[0]


def _mean_over_steps(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The mean of each metric over the optimizer steps; a maximum (``*_max``) stays a max."""
    keys = {k for s in steps for k in s}
    return {
        k: (
            max(s[k] for s in steps if k in s)
            if k.endswith("_max")
            else sum(s[k] for s in steps if k in s) / sum(1 for s in steps if k in s)
        )
        for k in sorted(keys)
    }


def _batch_metrics(batch: RolloutBatch) -> dict[str, float]:
    rewards = batch.rewards.to(torch.float64)
    lengths = batch.response_lengths.to(torch.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/max": float(rewards.max()),
        "reward/min": float(rewards.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "samples": float(len(batch)),
        **_episode_metrics(batch),
    }


def _episode_metrics(batch: RolloutBatch) -> dict[str, float]:
    """Means over the samples of a multi-turn rollout (each sample's ``metadata["episode"]``,
    written by the episode loop of `unirl.rollouts`): ``episode/turns`` per episode,
    ``episode/tool_calls`` (observations returned), ``episode/truncated`` and
    ``episode/env_failed`` (fractions). Empty for single-turn rollouts."""
    episodes = [s.metadata.get("episode") for s in batch.samples]
    if not episodes or not all(isinstance(e, Mapping) for e in episodes):
        return {}
    keys = ("turns", "tool_calls", "truncated", "env_failed")
    return {
        f"episode/{k}": sum(float(e.get(k, 0)) for e in episodes) / len(episodes)  # type: ignore[union-attr]
        for k in keys
    }


def _compares_rollout(decision: OldLogprobDecision) -> bool:
    """Whether the loss gets the rollout's log-probs beside the old ones. With old_logprobs:
    rollout they are the old ones: the train/rollout mismatch would compare them with
    themselves (0 by construction), so it is not computed and its metrics are absent (the
    config refuses rollout correction there, which would weigh every token by exp(0))."""
    return decision.source != "rollout"
