"""The contract's multi-turn batch: the fixture's samples as tool-use episodes, run on every
backend's main layout (one more RL step in each layout's process group, `measure`), checked
against a per-turn Python loop written here (`reference_step`).

The batch (`records`): every fixture sample of at least 6 response tokens becomes an episode of
turns and observations. Response tokens 2-3 (and 6, from 9 tokens up) are an environment's
observation: loss mask 0 and rollout log-prob 0 (the engine did not sample them); the policy's
tokens keep their rollout log-probs. Per-turn rewards sit on each turn's last token
(``token_rewards``: 0.25 for the first turn, 0.1 for the second, the rest of the sample's reward
on the last); the other samples carry zero token rewards, so their whole reward is the outcome.
The step: PPO clip on the rollout log-probs (``old_logprobs: rollout``), token-mean, REINFORCE++
(a token-level estimator: it reads the token rewards; gamma 1, whitened over the batch).

The reference, per sample and per turn (a turn: a run of trained tokens), runs the model on the
episode up to the end of that turn and takes the turn's log-probs from it; returns-to-go sum the
rewards at the trained tokens from t on; advantages are whitened over every trained token of the
batch (unbiased variance, 1e-8); the loss is the clipped PPO term summed over trained tokens over
their count; gradient norm, clipping and AdamW as in `tests.contract.reference`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tests.contract import fixtures, reference

NAME = "multiturn"
FIRST_TURN_REWARD, SECOND_TURN_REWARD = 0.25, 0.1
WHITEN_EPS = 1e-8  # unirl.core.maths.advantages.whitening's default, verl's too
VARIANT: dict[str, Any] = {
    "overrides": {
        "old_logprobs": "rollout",
        "algorithm": {
            "policy_loss": "ppo_clip",
            "advantage_estimator": "reinforce_pp",
            "clip_low": 0.2,
            "clip_high": 0.28,
            "loss_aggregation": "token-mean",
            "entropy_coef": 0.0,
        },
    },
    "data": ("rollout_logprobs",),
}


def _observations(n: int) -> set[int]:
    return ({2, 3} if n >= 6 else set()) | ({6} if n >= 9 else set())


def records(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fixture's records as multi-turn episodes (see the module docstring)."""
    out = []
    for rec in fixtures.select_fields(base, VARIANT["data"]):
        rec = dict(rec)
        n = len(rec["response_tokens"])
        token_rewards = [0.0] * n
        obs = _observations(n) if all(rec["loss_mask"]) else set()
        if obs:
            rec["loss_mask"] = [0 if t in obs else 1 for t in range(n)]
            rec["rollout_logprobs"] = [
                0.0 if t in obs else lp for t, lp in enumerate(rec["rollout_logprobs"])
            ]
            ends = [t for t in range(n) if t not in obs and (t + 1 in obs or t == n - 1)]
            turn_rewards = [FIRST_TURN_REWARD, SECOND_TURN_REWARD][: len(ends) - 1]
            turn_rewards.append(rec["reward"] - sum(turn_rewards))
            for t, r in zip(ends, turn_rewards):
                token_rewards[t] = r
        rec["token_rewards"] = token_rewards
        out.append(rec)
    assert any(len(_turns(r["loss_mask"])) >= 3 for r in out)
    return out


def _turns(mask: list[int]) -> list[tuple[int, int]]:
    """``[(start, end))`` of every run of trained tokens."""
    runs, t = [], 0
    while t < len(mask):
        if mask[t]:
            start = t
            while t < len(mask) and mask[t]:
                t += 1
            runs.append((start, t))
        else:
            t += 1
    return runs


def _loss(model: torch.nn.Module, recs: list[Mapping[str, Any]], cfg: Mapping[str, Any]):
    a = cfg["algorithm"]
    temperature = cfg["rollout"]["temperature"]
    lo, hi = 1.0 - a["clip_low"], 1.0 + a["clip_high"]
    # returns-to-go over trained tokens, then whitened over the batch
    returns: list[dict[int, float]] = []
    for rec in recs:
        mask, rewards = rec["loss_mask"], rec["token_rewards"]
        valid = [t for t in range(len(mask)) if mask[t]]
        outcome = rec["reward"] - sum(rewards)  # lands on the last trained token
        g, running = {}, 0.0
        for t in reversed(valid):
            running += rewards[t] + (outcome if t == valid[-1] else 0.0)
            g[t] = running
        returns.append(g)
    flat = [v for g in returns for v in g.values()]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    terms = []
    for rec, g in zip(recs, returns):
        prompt, response = list(rec["prompt_tokens"]), list(rec["response_tokens"])
        p = len(prompt)
        for start, end in _turns(rec["loss_mask"]):
            # the episode up to the end of this turn: what the policy saw when it wrote it
            ids = torch.tensor([prompt + response[:end]])
            logits = model(input_ids=ids).logits[0].float() / temperature
            logp_rows = torch.log_softmax(logits[p - 1 + start : p - 1 + end], dim=-1)
            for k, t in enumerate(range(start, end)):
                lp = logp_rows[k, response[t]]
                adv = (g[t] - mean) / math.sqrt(var + WHITEN_EPS)
                ratio = torch.exp(lp - rec["rollout_logprobs"][t])
                terms.append(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, lo, hi)))
    return torch.stack(terms).sum() / len(terms)


def reference_step(model_dir: str | Path, base: list[dict[str, Any]]) -> dict[str, Any]:
    """The reference's loss, gradient norm and weights after the step."""
    cfg = fixtures.variant_config(
        fixtures.base_config(
            backend="reference",
            model_dir=str(model_dir),
            world_size=1,
            parallel={},
            dtype="fp32",
            run_dir="",
        ),
        VARIANT,
    )
    with reference.single_thread():
        run = reference.ReferenceRun(reference.load_model(model_dir), cfg)
        run.opt.zero_grad(set_to_none=False)
        loss = _loss(run.model, records(base), cfg)
        loss.backward()
        params = list(run.model.parameters())
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
        coef = min(1.0, run.s.grad_clip / (norm + reference.CLIP_EPS))
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
        run.opt.step()
        return {"loss": float(loss.detach()), "grad_norm": norm, "weights": run.weights()}


def is_main_layout(backend: str, layout: Any) -> bool:
    """The batch runs on each backend's first (main) layout only: one step more per backend."""
    from tests.contract.backends import REGISTRY

    return layout == REGISTRY[backend].layouts[0]


def measure(run: Any, backend: Any) -> None:
    """The harness's hook (`tests.contract.harness._GroupRun`): on a main layout, one RL step on
    the multi-turn batch from the initial state; its metrics and exported weights go to
    ``out["multiturn"]``."""
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.step import RLStep

    if not is_main_layout(run.job.backend, run.job.layout):
        return
    with run.section(f"variant:{NAME}"):
        backend.load_checkpoint(run.init_ckpt)
        batch = RolloutBatch.from_records(records(run.job.records))
        result = RLStep(run.cfg_of(VARIANT), backend).run(batch, rl_step=0)
        export = run.work / "export" / NAME
        backend.export_hf(export)
        run.out[NAME] = {"metrics": dict(result.metrics), "export": str(export)}


def clause_multiturn(m: Any, expected: Mapping[str, Any], tol: Any) -> list[Any]:
    """The multi-turn step's loss, gradient norm and weights equal the per-turn reference's."""
    from tests.contract.clauses import close, close_dicts, load_export

    m.need(f"variant:{NAME}")
    got = m.reporting[NAME]
    checks = [
        close(NAME, f"{NAME}: {key}", got["metrics"].get(key, math.nan), expected[key], tol)
        for key in ("loss", "grad_norm")
    ]
    checks += close_dicts(
        NAME, f"{NAME}: weight", load_export(got["export"]), expected["weights"], tol
    )
    return checks
