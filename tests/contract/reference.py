"""The independent reference: one process, fp32, plain PyTorch + transformers, no unirl code.

Everything a backend computes in an RL step is written out here the slow, obvious way:

- log-probs: one sequence at a time, ``log_softmax(model(ids).logits / T)`` gathered at the next
  token (eager attention, no packing);
- GRPO advantages: a Python loop over groups, ``(r - mean) / (std_unbiased + 1e-6)``;
- the policy losses, KL estimators, entropy bonus, TIS weight and aggregation modes: per token,
  from the papers' formulas, with autograd through the loop for the gradient;
- the gradient norm: ``sqrt(sum g^2)`` by hand; clipping ``g *= min(1, clip / (norm + 1e-6))``;
- the update: `torch.optim.AdamW` with the config's lr / betas / eps / weight decay (on
  matrices and embeddings, not on 1-D norm weights: unirl's convention).

It reads the run configuration as the plain dict a user writes (never unirl's settings classes),
so a mistake in unirl's config plumbing shows up as a difference.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tests.contract import moe_reference

F32 = torch.float32
GRPO_EPS = 1e-6  # the epsilon added to the group std (verl / TRL use the same)
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s epsilon in the clip coefficient


def _val(t: torch.Tensor) -> float:
    return t.detach().item()


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread while the reference runs: its many tiny ops are several times faster
    without thread hand-offs (and CI has 2 cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_model(path: str | Path, attn_implementation: str | None = "eager") -> torch.nn.Module:
    """The HF model in fp32; eager attention by default (no kernel shared with a backend),
    ``None`` for whatever transformers picks (as a user loading an export gets)."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if attn_implementation is not None and _model_type(path) == "qwen3_moe":
        kwargs["experts_implementation"] = "eager"  # a loop over the experts, no fused kernel
    model = AutoModelForCausalLM.from_pretrained(path, dtype=F32, **kwargs)
    model.train()  # dropout is 0: train and eval give the same numbers
    return model


def _model_type(path: str | Path) -> str:
    import json

    return json.loads((Path(path) / "config.json").read_text())["model_type"]


def sequence_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    response: list[int],
    temperature: float,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens of one sequence, ``[R]`` each.

    Token ``j`` of the sequence is predicted by the logits at ``j - 1``.
    """
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].to(F32) / temperature  # [S, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    p = len(prompt)
    rows = logp_all[p - 1 : p - 1 + len(response)]  # the rows that predict the response
    logp = rows.gather(1, torch.tensor(response)[:, None])[:, 0]
    entropy = None
    if with_entropy:
        entropy = -(rows.exp() * rows).sum(dim=-1)
    return logp, entropy


def batch_logprobs(
    model: torch.nn.Module, records: list[Mapping[str, Any]], temperature: float
) -> list[torch.Tensor]:
    """Detached response log-probs of every record, one sequence at a time."""
    with torch.no_grad():
        return [
            sequence_logprobs(model, r["prompt_tokens"], r["response_tokens"], temperature)[0]
            for r in records
        ]


def grpo_advantages(records: list[Mapping[str, Any]]) -> list[float]:
    """GRPO: within each group, ``(r_i - mean) / (std + eps)`` with the unbiased std."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(r["group_id"], []).append(i)
    adv = [0.0] * len(records)
    for members in groups.values():
        rewards = [float(records[i]["reward"]) for i in members]
        mean = sum(rewards) / len(rewards)
        var = sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1)
        for i, x in zip(members, rewards):
            adv[i] = (x - mean) / (math.sqrt(var) + GRPO_EPS)
    return adv


def kl_term(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(policy || ref) estimate of one token (Schulman 2020; k3+ = k3's value, k2's grad)."""
    d = logp - ref
    k2 = 0.5 * d * d
    k3 = torch.exp(-d) + d - 1.0
    if estimator == "k1":
        return d
    if estimator == "k2":
        return k2
    if estimator == "k3":
        return k3
    if estimator == "low_var_kl":
        return torch.clamp(k3, -10.0, 10.0)
    if estimator == "k3+":
        return k2 + (k3 - k2).detach()
    raise ValueError(estimator)


class Settings:
    """What the reference reads from a plain config dict; unset keys take the documented
    defaults of the user-facing config (PPO clip 0.2, low_var_kl, token-mean, ...)."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        a = cfg.get("algorithm", {})
        o = cfg["optimizer"]
        self.old_logprobs = cfg.get("old_logprobs", "auto")
        self.policy_loss = a.get("policy_loss", "ppo_clip")
        self.aggregation = a.get("loss_aggregation", "token-mean")
        self.clip_low = a.get("clip_low", 0.2)
        self.clip_high = a.get("clip_high", 0.2)
        self.dual_clip = a.get("dual_clip")
        self.entropy_coef = a.get("entropy_coef", 0.0)
        self.mask_truncated = a.get("mask_truncated", False)
        kl = a.get("kl_loss", {})
        self.kl_coef = kl.get("coef", 0.0)
        self.kl_estimator = kl.get("estimator", "low_var_kl")
        rc = a.get("rollout_correction", {})
        self.tis = rc.get("mode", "none")
        assert self.tis in ("none", "tis"), "the reference writes out TIS only"
        self.tis_high = rc.get("high", 2.0)
        self.norm_length = a.get("norm_length") or cfg["rollout"]["max_new_tokens"]
        self.temperature = cfg["rollout"]["temperature"]
        self.lr = o["lr"]
        self.betas = tuple(o["betas"])
        self.eps = o["eps"]
        self.weight_decay = o["weight_decay"]
        self.grad_clip = o["grad_clip"]
        assert o["lr_schedule"] == "constant"
        # a mixture-of-experts policy's router term (Qwen3-MoE's own aux coefficient by default)
        self.router_aux_coef = a.get("router_aux_loss_coef", 0.001)
        self.router_z_coef = a.get("router_z_loss_coef", 0.0)


def step_loss(
    model: torch.nn.Module,
    records: list[Mapping[str, Any]],
    s: Settings,
    ref_logprobs: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one optimizer step over the whole batch and every loss metric, per token."""
    adv = grpo_advantages(records)
    lo, hi = 1.0 - s.clip_low, 1.0 + s.clip_high
    # Per sample: lists of per-token scalars (valid tokens only) for each term.
    pg, kl, ent, total = [], [], [], []
    flags: dict[str, list[float]] = {}  # token-mean metrics: flat lists over valid tokens
    maxima: dict[str, float] = {}  # max metrics over valid tokens

    def flag(name: str, value: float) -> None:
        flags.setdefault(name, []).append(float(value))

    # the train/rollout mismatch metrics exist where the old log-probs are not the rollout's own
    # (with old_logprobs: rollout they would compare the rollout's log-probs with themselves)
    has_rollout = "rollout_logprobs" in records[0] and s.old_logprobs != "rollout"
    for i, rec in enumerate(records):
        logp, entropy = sequence_logprobs(
            model, rec["prompt_tokens"], rec["response_tokens"], s.temperature, with_entropy=True
        )
        assert entropy is not None
        mask = rec["loss_mask"]
        if s.mask_truncated and not rec.get("metadata", {}).get("finished", True):
            mask = [0] * len(mask)  # cut by the engine: no token trains
        if s.old_logprobs == "rollout":
            old = torch.tensor(rec["rollout_logprobs"], dtype=F32)
        else:  # recompute / reuse: the policy before the step is this forward's policy
            old = logp.detach()
        a = adv[i]
        seq_pg, seq_kl, seq_ent, seq_total = [], [], [], []
        # GSPO's sequence ratio: the geometric mean of the token ratios over valid tokens.
        valid = [t for t in range(len(mask)) if mask[t]]
        if s.policy_loss == "gspo" and valid:
            mean_log_ratio = sum(_val(logp[t] - old[t]) for t in valid) / len(valid)
            seq_ratio = math.exp(mean_log_ratio)
        for t in valid:
            lp = logp[t]
            ratio = torch.exp(lp - old[t])
            if s.policy_loss == "ppo_clip":
                unclipped = -a * ratio
                clipped = -a * torch.clamp(ratio, lo, hi)
                loss_t = torch.maximum(unclipped, clipped)
                flag("pg_clipfrac", clipped > unclipped)
                if s.dual_clip is not None:
                    flag("pg_clipfrac_lower", a < 0 and _val(loss_t) > -s.dual_clip * a)
                    if a < 0:
                        loss_t = torch.minimum(loss_t, torch.tensor(-s.dual_clip * a))
            elif s.policy_loss == "gspo":
                # sg(s_i) * exp(logp - sg(logp)): value s_i, gradient of the token's log-prob
                r_it = seq_ratio * torch.exp(lp - lp.detach())
                unclipped = -a * r_it
                clipped = -a * torch.clamp(r_it, lo, hi)
                loss_t = torch.maximum(unclipped, clipped)
                flag("pg_clipfrac", clipped > unclipped)
            elif s.policy_loss == "cispo":
                r = _val(ratio)
                weight = min(max(r, lo), hi)  # a constant: only logp carries the gradient
                loss_t = -weight * a * lp
                flag("pg_clipfrac", r < lo or r > hi)
            elif s.policy_loss == "reinforce":
                loss_t = -a * lp
            else:
                raise ValueError(s.policy_loss)
            if s.tis == "tis":
                rho = math.exp(_val(old[t]) - rec["rollout_logprobs"][t])
                flag("is_weight_mean", min(rho, s.tis_high))
                flag("is_clipfrac", rho > s.tis_high)
                loss_t = min(rho, s.tis_high) * loss_t
            term = loss_t
            if ref_logprobs is not None:
                k = kl_term(lp, ref_logprobs[i][t], s.kl_estimator)
                seq_kl.append(k)
                flag("kl", _val(k))
                if s.kl_coef:
                    term = term + s.kl_coef * k
            if s.entropy_coef:
                term = term - s.entropy_coef * entropy[t]
            flag("entropy", _val(entropy[t]))
            flag("ppo_kl", _val(old[t] - lp))
            if has_rollout:
                diff = _val(old[t]) - rec["rollout_logprobs"][t]
                flag("train_rollout_logprob_abs_diff", abs(diff))
                flag("train_rollout_kl", math.exp(diff) - 1 - diff)  # k3 of KL(rollout || train)
                maxima["train_rollout_logprob_abs_diff_max"] = max(
                    maxima.get("train_rollout_logprob_abs_diff_max", 0.0), abs(diff)
                )
            seq_pg.append(loss_t)
            seq_ent.append(entropy[t])
            seq_total.append(term)
        pg.append(seq_pg)
        kl.append(seq_kl)
        ent.append(seq_ent)
        total.append(seq_total)

    num_tokens = sum(len(x) for x in total)
    num_seqs = sum(1 for x in total if x)

    def aggregate(per_seq: list[list[torch.Tensor]]) -> torch.Tensor:
        out = torch.zeros((), dtype=F32)
        for terms in per_seq:
            if not terms:
                continue
            seq_sum = torch.stack(terms).sum()
            if s.aggregation == "token-mean":
                out = out + seq_sum / num_tokens
            elif s.aggregation == "seq-mean-token-mean":
                out = out + seq_sum / len(terms) / num_seqs
            elif s.aggregation == "seq-mean-token-sum":
                out = out + seq_sum / num_seqs
            elif s.aggregation == "seq-mean-token-sum-norm":
                out = out + seq_sum / (num_seqs * s.norm_length)
            else:
                raise ValueError(s.aggregation)
        return out

    loss = aggregate(total)
    metrics = {"loss": _val(loss), "pg_loss": _val(aggregate(pg))}
    if ref_logprobs is not None and s.kl_coef:
        metrics["kl_loss"] = _val(aggregate(kl))
    for name, values in flags.items():
        if name == "kl" and ref_logprobs is None:
            continue
        metrics[name] = sum(values) / len(values)
    metrics.update(maxima)
    return loss, metrics


def batch_metrics(records: list[Mapping[str, Any]]) -> dict[str, float]:
    rewards = [float(r["reward"]) for r in records]
    lengths = [len(r["response_tokens"]) for r in records]
    mean = sum(rewards) / len(rewards)
    return {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)),
        "reward/max": max(rewards),
        "reward/min": min(rewards),
        "response_length/mean": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "samples": float(len(records)),
    }


class ReferenceRun:
    """A policy (and a frozen copy as the reference model) stepping with AdamW, one process.
    A mixture-of-experts policy adds the router term of the microbatch split it is given
    (`moe_reference.router_term`); ``forced``: experts per sequence (by its token ids) that the
    policy's routing is forced to (`moe_reference.ForcedRouting`; the reference model routes
    freely)."""

    def __init__(
        self,
        initial: torch.nn.Module,
        cfg: Mapping[str, Any],
        forced: Mapping[tuple[int, ...], Any] | None = None,
    ) -> None:
        self.s = Settings(cfg)
        self.model = copy.deepcopy(initial)
        self.ref_model = copy.deepcopy(initial)
        self.moe = moe_reference.is_moe(initial)
        self.forced = None if forced is None else moe_reference.ForcedRouting(self.model, forced)
        # unirl's convention (Megatron-core's and the HF Trainer's too): weight decay on matrices
        # and embeddings only, never on 1-D parameters (norm weights, biases).
        matrices = [p for p in self.model.parameters() if p.dim() >= 2]
        vectors = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": self.s.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=self.s.lr,
            betas=self.s.betas,
            eps=self.s.eps,
        )

    def step(
        self, records: list[Mapping[str, Any]], splits: Sequence[Sequence[int]] | None = None
    ) -> dict[str, Any]:
        """One RL step (one optimizer step): metrics, gradient norm (pre-clip) and whether the
        clip was active. ``splits``: an MoE policy's training microbatches (sample indices)."""
        s = self.s
        if "ref_logprobs" in records[0]:
            ref = [torch.tensor(r["ref_logprobs"], dtype=F32) for r in records]
        elif s.kl_coef:
            ref = batch_logprobs(self.ref_model, records, s.temperature)
        else:
            ref = None
        self.opt.zero_grad(set_to_none=False)
        if self.forced is not None:
            self.forced.take_disagreement()  # count this step's forwards only
        loss, metrics = step_loss(self.model, records, s, ref)
        if self.moe:
            assert splits is not None, "an MoE step's router term needs the microbatch split"
            term, router_metrics = moe_reference.router_term(
                self.model, records, splits, aux_coef=s.router_aux_coef, z_coef=s.router_z_coef
            )
            loss = loss + term  # trained on; the "loss" metric stays the policy's (unirl's)
            metrics.update(router_metrics)
            if self.forced is not None:
                metrics["router/disagreement"] = self.forced.take_disagreement()
        loss.backward()
        params = [p for p in self.model.parameters()]
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
        coef = min(1.0, s.grad_clip / (norm + CLIP_EPS))
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
        self.opt.step()
        metrics.update(batch_metrics(records))
        if s.mask_truncated:
            cut = sum(not r.get("metadata", {}).get("finished", True) for r in records)
            metrics["rollout/truncated_masked_fraction"] = cut / len(records)
        metrics.update(
            {
                "grad_norm": norm,
                "lr": s.lr,
                "skipped_steps": 0.0,
                "optimizer_steps": 1.0,
                "old_logprobs/recompute": float(s.old_logprobs == "recompute"),
            }
        )
        return {"metrics": metrics, "clipped": coef < 1.0}

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights in checkpoint names (the experts per expert)."""
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return moe_reference.per_expert(state) if self.moe else state

    def logprobs(self, records: list[Mapping[str, Any]]) -> list[torch.Tensor]:
        return batch_logprobs(self.model, records, self.s.temperature)
