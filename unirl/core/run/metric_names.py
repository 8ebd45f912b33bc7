"""What each metric a run logs means: one line per name, the source of the generated metrics
reference (``docs/gen_metrics_reference.py`` -> ``docs/reference/metrics.md``).

The names are those the code writes into ``metrics.jsonl`` (and TensorBoard / W&B), kept here
beside ``metrics_log`` rather than at each producer because the producers are spread over core,
the losses, the rollout sources and the backends; ``tests/unit/test_docs_metrics.py`` runs short
real trainings and fails when one of their keys, or a namespaced key literal in the code, has no
line here. ``{k}``-style parts are placeholders that match one path segment's variable part.
"""

from __future__ import annotations

import re

METRICS: dict[str, str] = {
    # the run's bookkeeping
    "step": "The RL step this line is for (1-based).",
    "samples": "Samples (responses) in the rollout this step trained on.",
    "optimizer_steps": "The policy's optimizer steps this RL step (the rollout's samples over the samples per optimizer step, x epochs).",
    "skipped_steps": "Optimizer steps skipped this RL step (a non-finite gradient norm: the update is dropped).",
    "lr": "The policy's learning rate.",
    "grad_norm": "The policy's gradient norm before clipping, mean over this step's optimizer steps.",
    # the loss and its terms (means over the step's optimizer steps)
    "loss": "The total loss the optimizer minimised (policy loss + KL term - entropy bonus + router terms), aggregated as algorithm.loss_aggregation says.",
    "pg_loss": "The policy-gradient term alone (the chosen policy loss: PPO-clip, GSPO, CISPO, ...).",
    "pg_clipfrac": "Fraction of response tokens whose ratio was clipped (or, for CISPO, whose weight was capped).",
    "pg_clipfrac_lower": "Fraction of tokens clipped by dual-clip PPO's lower bound (negative advantages, ratio above clip_ratio_c).",
    "ppo_kl": "Mean of old minus current log-prob over response tokens: how far this step's optimizer steps moved the policy from the old one (k1).",
    "entropy": "Mean entropy of the policy's next-token distribution over response tokens (at the sampling temperature).",
    "kl": "Mean KL to the reference model over response tokens, by the configured estimator (when a reference runs).",
    "kl_loss": "The KL to the reference aggregated as the loss is (before its coefficient); only when the KL coefficient is not 0.",
    "is_weight_mean": "Rollout correction (TIS / IcePop): mean importance weight trainer/rollout over response tokens.",
    "is_clipfrac": "Rollout correction: fraction of tokens whose importance weight was truncated or masked.",
    "decoupled_weight_mean": "Decoupled PPO: mean behaviour weight min(exp(proximal - behaviour), decoupled_cap).",
    "decoupled_clipfrac": "Decoupled PPO: fraction of tokens whose behaviour weight hit decoupled_cap.",
    # trainer against the rollout engine
    "train_rollout_logprob_abs_diff": "Mean |trainer's old log-prob - rollout log-prob| over response tokens: a stale engine or the numerics gap.",
    "train_rollout_logprob_abs_diff_max": "The largest such difference over the rollout's tokens.",
    "train_rollout_kl": "KL(rollout || trainer) over response tokens (k3): the engine-trainer mismatch as a divergence.",
    "mismatch/staleness_{s}/abs_diff": "Mean |proximal - behaviour| log-prob over the samples generated {s} policy versions ago.",
    "mismatch/staleness_{s}/kl": "KL(behaviour || proximal) (k3) over the samples generated {s} versions ago.",
    "mismatch/staleness_{s}/tokens": "Response tokens of the samples generated {s} versions ago.",
    # the old-log-prob decision
    "old_logprobs/source": "Where the ratio's old log-probs came from: recompute, reuse or rollout (the decision unirl check prints).",
    "old_logprobs/recompute": "1 when a forward-only pass recomputed the old log-probs this step, else 0.",
    # rewards and responses
    "reward/mean": "Mean reward over the rollout's samples (after shaping such as the overlong penalty).",
    "reward/std": "Standard deviation of the rewards over the rollout's samples.",
    "reward/max": "Largest reward in the rollout.",
    "reward/min": "Smallest reward in the rollout.",
    "reward/task_mean": "Mean of the task's own reward, before the overlong penalty was added.",
    "reward/overlong_penalty": "Mean overlong penalty (DAPO's soft length penalty) added to the rewards.",
    "response_length/mean": "Mean response length in tokens.",
    "response_length/max": "Longest response in tokens.",
    # the rollout and its source
    "rollout/policy_version": "The oldest policy version among the rollout's samples (the weights that generated them).",
    "rollout/staleness": "How many RL steps older than the trainer the rollout's oldest sample is (0: on-policy).",
    "rollout/staleness_mean": "Mean staleness over the rollout's samples (asynchronous training).",
    "rollout/staleness_max": "Largest staleness among the rollout's samples (at most train.max_staleness).",
    "rollout/truncated_masked_fraction": "Fraction of samples the engine cut at max_new_tokens whose loss mask was zeroed (DAPO's truncation mask).",
    "rollout/draws": "Generation rounds dynamic sampling drew to fill this rollout.",
    "rollout/groups_drawn": "Prompt groups generated for this rollout, kept or not (dynamic sampling).",
    "rollout/groups_kept": "Groups kept: those whose rewards were not all equal (dynamic sampling).",
    "rollout/groups_kept_fraction": "Kept groups over drawn groups (dynamic sampling).",
    "rollout/padding_groups": "Groups repeated to fill the rollout when the draw limit was reached (dynamic sampling).",
    "rollout/discarded_generation_s": "Seconds spent generating groups dynamic sampling then discarded.",
    "rollout/discarded_generation_fraction": "Fraction of this rollout's generation time spent on discarded groups.",
    "rollout/engine_restarts": "Engine restarts so far in the run (a dead or hung rollout engine restarted and re-synced).",
    # multi-turn episodes
    "episode/turns": "Mean turns per episode (multi-turn rollouts).",
    "episode/tool_calls": "Mean observations the environment returned per episode.",
    "episode/truncated": "Fraction of episodes cut by max_turns or the episode token budget.",
    "episode/env_failed": "Fraction of episodes the environment failed (they get the failure reward).",
    # the agent gateway (rollout.source: agent)
    "gateway/calls_per_episode": "Mean calls an agent made per episode.",
    "gateway/failed_episodes": "Episodes that ended in a failure (crashed, timeout, a request limit, no call, a bad reward).",
    "gateway/forked_episodes": "Episodes whose calls did not all extend one sample (each trains on its last fork).",
    "gateway/dropped_calls": "Calls of forked episodes outside the fork that trains (recorded, not trained).",
    "gateway/late_calls": "Calls refused because their episode had ended.",
    "gateway/episode_s": "Seconds of the rollout's longest episode.",
    "gateway/engine_imbalance": "Several engines: the busiest engine's episodes over the fair share (1: even).",
    # routing (mixture of experts)
    "router/aux_loss": "The router's load-balancing auxiliary loss (MoE), as it enters the loss.",
    "router/z_loss": "The router's z-loss (MoE), as it enters the loss.",
    "router/disagreement": "Routing replay: fraction of routing decisions whose free top-k differs from the replayed experts.",
    # the critic (PPO with GAE)
    "critic/value_loss": "The value loss the critic's optimizer minimised (clipped when value_clip is set).",
    "critic/vf_clipfrac": "Fraction of tokens whose value prediction was clipped.",
    "critic/values_mean": "Mean predicted value over response tokens, before the critic's update.",
    "critic/values_abs_error": "Mean |value - return| over response tokens, before the update.",
    "critic/returns_mean": "Mean GAE return over response tokens.",
    "critic/explained_variance": "1 - Var(returns - values) / Var(returns): how much of the returns the critic explains.",
    "critic/grad_norm": "The critic's gradient norm before clipping.",
    "critic/lr": "The critic's learning rate.",
    "critic/skipped_steps": "The critic's skipped optimizer steps (non-finite gradient norm).",
    "critic/warmup": "1 while the critic warms up (only the critic trains), else 0.",
    # evaluation
    "eval/reward_mean": "Mean reward on the evaluation prompts (logged on evaluation steps).",
    "eval/pass@{k}": "Unbiased pass@k on the evaluation prompts: the chance one of k samples is correct.",
    "eval/response_length_mean": "Mean response length on the evaluation prompts.",
    "eval/prompts": "Evaluation prompts scored.",
    # throughput and time
    "throughput/train_tokens_per_s": "Tokens (prompt + response) trained per second of the training phase.",
    "time/step_s": "Seconds of the whole RL step.",
    "time/generation_s": "Seconds generating the rollout (the trainer waiting for it).",
    "time/rollout_wait_s": "Asynchronous training: seconds the trainer waited for a rollout that was not ready.",
    "time/overlap_s": "Asynchronous training: seconds of generation hidden behind training.",
    "time/generator_idle_s": "Asynchronous training: seconds the generation worker waited for new weights.",
    "time/actor_forward_s": "Seconds of the forward-only pass that recomputed the old log-probs.",
    "time/ref_forward_s": "Seconds of the reference model's forward-only pass.",
    "time/critic_forward_s": "Seconds of the critic's forward-only pass (values).",
    "time/advantages_s": "Seconds computing rewards into advantages (and returns).",
    "time/train_s": "Seconds of the policy's optimizer steps (forward, backward, step).",
    "time/critic_train_s": "Seconds of the critic's optimizer steps.",
    "time/weight_sync_s": "Seconds streaming the new weights to the rollout engine or sampler.",
    "weight_sync/bytes": "Bytes the weight sync sent this step: the whole model, or under model.lora the adapter alone (the first sync also the base weights once).",
    "time/verify_s": "Seconds the verified sync took (the receiver's fingerprints compared with the stream's).",
    "time/eval_s": "Seconds of the evaluation, on evaluation steps.",
}


def _pattern(name: str) -> re.Pattern[str]:
    parts = re.split(r"\{\w+\}", name)
    return re.compile("^" + r"[^/]+".join(re.escape(p) for p in parts) + "$")


_PATTERNS = {name: _pattern(name) for name in METRICS}


def entry_for(key: str) -> str | None:
    """The documented name a logged key falls under (itself, or a ``{k}`` pattern), or None."""
    if key in METRICS:
        return key
    return next((name for name, rx in _PATTERNS.items() if rx.match(key)), None)


def namespace(name: str) -> str:
    """The group a name is listed under: the part before its first ``/`` ('' for flat names)."""
    return name.split("/", 1)[0] if "/" in name else ""


def dashboard_name(key: str) -> str:
    """The name a metric has in TensorBoard and W&B: the flat names of the step's loss terms and
    counters (``loss``, ``grad_norm``, ``pg_clipfrac``, ...) under ``train/``, so dashboards group
    every metric by namespace; ``metrics.jsonl`` keeps the names as the code writes them."""
    return key if "/" in key else f"train/{key}"
