"""The critic's independent reference: one process, fp32, plain PyTorch + transformers, no unirl.

- the value model: ``AutoModelForTokenClassification`` with one label and no classifier dropout,
  its head drawn by transformers' init right after ``torch.manual_seed(model.init_seed)``, its
  backbone the causal LM's (unirl's documented initialisation from the policy);
- values: one sequence at a time, eager attention; the value before response token j is the
  head's output at position ``p + j - 1`` (the position whose logits predict that token);
- GAE: a Python loop over each response's valid tokens, backwards (masked tokens skipped);
- the value loss ``0.5 max((v - R)^2, (v_clip - R)^2)`` with ``v_clip`` = v clamped into
  ``old +- value_clip`` (a token counts in ``vf_clipfrac`` only where the clamp moved it), token-mean over the valid tokens of the
  batch, times value_coef; gradient norm by hand, clipping ``g *= min(1, clip / (norm + 1e-6))``,
  `torch.optim.AdamW` (decay on matrices only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tests.contract.reference import CLIP_EPS, F32

EV_EPS = 1e-8  # the explained variance's guard against a zero variance (as verl's)


def build_critic(model_dir: str | Path, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=F32, attn_implementation="eager")
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    torch.manual_seed(seed)
    critic = AutoModelForTokenClassification.from_config(
        config, dtype=F32, attn_implementation="eager"
    )
    critic.model.load_state_dict(lm.model.state_dict())
    critic.train()  # no dropout anywhere: train and eval agree
    return critic


def sequence_values(critic: torch.nn.Module, record: Mapping[str, Any]) -> torch.Tensor:
    """``[R]``: the value before each response token (with grad)."""
    prompt, response = record["prompt_tokens"], record["response_tokens"]
    out = critic(input_ids=torch.tensor([prompt + response])).logits[0, :, 0]
    p = len(prompt)
    return out[p - 1 : p - 1 + len(response)]


def gae(
    values: torch.Tensor, mask: list[int], reward: float, gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one response; the reward arrives at the last valid token, the
    value after the last valid token is 0, masked tokens are skipped."""
    valid = [j for j, m in enumerate(mask) if m]
    adv = [0.0] * len(mask)
    ret = [0.0] * len(mask)
    next_value, next_adv = 0.0, 0.0
    for j in reversed(valid):
        r = float(reward) if j == valid[-1] else 0.0
        v = float(values[j])
        delta = r + gamma * next_value - v
        a = delta + gamma * lam * next_adv
        adv[j], ret[j] = a, a + v
        next_value, next_adv = v, a
    return adv, ret


class CriticReference:
    """The critic trained for ``epochs`` optimizer steps on the whole batch, values clipped
    around the pre-step values from the second step on."""

    def __init__(self, model_dir: str | Path, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.critic = build_critic(model_dir, cfg["model"].get("init_seed", 0))
        opt = cfg["critic"]["optimizer"]
        matrices = [p for p in self.critic.parameters() if p.dim() >= 2]
        vectors = [p for p in self.critic.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": opt["weight_decay"]},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=opt["lr"],
            betas=tuple(opt["betas"]),
            eps=opt["eps"],
        )
        self.grad_clip = opt["grad_clip"]

    def values(self, records: list[Mapping[str, Any]]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [sequence_values(self.critic, r) for r in records]

    def rl_step(self, records: list[Mapping[str, Any]]) -> dict[str, Any]:
        a = self.cfg["algorithm"]
        gamma, lam, clip, coef = a["gamma"], a["lam"], a["value_clip"], a["value_coef"]
        old = self.values(records)
        masks = [r["loss_mask"] for r in records]
        returns = [
            torch.tensor(gae(v, m, r["reward"], gamma, lam)[1], dtype=F32)
            for v, m, r in zip(old, masks, records)
        ]
        n_valid = sum(sum(m) for m in masks)
        steps = []
        for _ in range(self.cfg["batch"]["epochs_per_rollout"]):
            self.opt.zero_grad(set_to_none=False)
            total = torch.zeros((), dtype=F32)
            clipped = 0
            for rec, v_old, ret, mask in zip(records, old, returns, masks):
                v = sequence_values(self.critic, rec)
                for j, m in enumerate(mask):
                    if not m:
                        continue
                    err = (v[j] - ret[j]) ** 2
                    v_clip = v[j].clamp(v_old[j] - clip, v_old[j] + clip)
                    err_clip = (v_clip - ret[j]) ** 2
                    # clipped: the clip moved the value (|v - old| > c) and its error is the
                    # larger; a value inside the range is never counted
                    outside = abs(float(v[j].detach()) - float(v_old[j])) > clip
                    clipped += int(outside and err_clip.item() > err.item())
                    total = total + 0.5 * torch.maximum(err, err_clip)
            loss = total / n_valid
            (coef * loss).backward()
            params = list(self.critic.parameters())
            norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
            scale = min(1.0, self.grad_clip / (norm + CLIP_EPS))
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(scale)
            self.opt.step()
            steps.append(
                {
                    "value_loss": float(loss.detach()),
                    "vf_clipfrac": clipped / n_valid,
                    "value_clipped": clipped,
                    "grad_norm": norm,
                    "clipped": scale < 1.0,
                }
            )
        v_all = torch.cat([v[torch.tensor(m, dtype=torch.bool)] for v, m in zip(old, masks)])
        r_all = torch.cat([r[torch.tensor(m, dtype=torch.bool)] for r, m in zip(returns, masks)])
        v64, r64 = v_all.double(), r_all.double()
        n = len(steps)
        metrics = {
            "critic/value_loss": sum(s["value_loss"] for s in steps) / n,
            "critic/vf_clipfrac": sum(s["vf_clipfrac"] for s in steps) / n,
            "critic/grad_norm": sum(s["grad_norm"] for s in steps) / n,
            "critic/lr": float(self.cfg["critic"]["optimizer"]["lr"]),
            "critic/skipped_steps": 0.0,
            "critic/values_mean": float(v64.mean()),
            "critic/returns_mean": float(r64.mean()),
            "critic/explained_variance": float(
                1 - (r64 - v64).var(unbiased=False) / (r64.var(unbiased=False) + EV_EPS)
            ),
            "critic/values_abs_error": float((r64 - v64).abs().mean()),
            # the policy waits one RL step (the contract's ``critic.warmup_steps: 1``)
            "critic/warmup": 1.0,
        }
        return {"metrics": metrics, "steps": steps}
