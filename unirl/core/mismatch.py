"""What the train/rollout mismatch metrics (``train_rollout_logprob_abs_diff``, ``_max``,
``train_rollout_kl``; `unirl.core.maths.losses.total`) measure for a config, in words, for
`unirl check`.

They compare the old log-probs the trainer uses with the rollout engine's. With
``old_logprobs: rollout`` those are the same tensor, so the comparison would be 0 by
construction: it is not made and the metrics are absent (`unirl.core.step`), and this note
says so. With ``rollout.top_p < 1`` a serving engine (vLLM) reports the log-probs of the
truncated, renormalised distribution it sampled from, so the mismatch also holds the
truncation, ``-log(kept probability mass)`` per token, on top of any numerics gap; the
built-in sampler reports the untruncated log-probs (the trainer's distribution), so its
mismatch holds no truncation, but the samples then come from a distribution those log-probs
do not describe. Which one a source does, its plug-in declares (`SourcePlugin.top_p_logprobs`).

Split by staleness (`mismatch_by_staleness`): under ``train.max_staleness > 0`` (or a rollout
whose samples are older than the trained policy) the step also logs, for each staleness ``s``
(policy versions the trained weights are ahead of the sample's) found among its samples, the
same comparison over those samples' response tokens alone: ``mismatch/staleness_{s}/abs_diff``
(mean ``|proximal - behaviour|``), ``mismatch/staleness_{s}/kl`` (KL(behaviour || proximal), k3)
and ``mismatch/staleness_{s}/tokens``. At ``s = 0`` it is the numerics gap between trainer and
engine; at ``s > 0`` it adds how far ``s`` versions of training moved the policy, which is what
decoupled PPO's weight corrects.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from unirl.core.config.run_config import UnirlConfig
from unirl.core.maths.kl import kl_estimate
from unirl.core.protocols.source_plugin import SOURCES


def mismatch_note(cfg: UnirlConfig, source: str) -> str:
    """One paragraph on the mismatch metrics for ``cfg`` with old log-probs from ``source``."""
    if source == "rollout":
        return (
            "train/rollout mismatch metrics: not logged: with old_logprobs: rollout the old "
            "log-probs are the rollout's own, so the comparison would be 0 by construction; "
            "use old_logprobs: auto or recompute to measure the engine against the trainer"
        )
    note = (
        "train/rollout mismatch metrics: logged when the rollout carries rollout_logprobs "
        f"(old log-probs from {source} vs the engine's)"
    )
    top_p, name = cfg.rollout.top_p, cfg.rollout.source
    kind = SOURCES.get(name).top_p_logprobs
    if top_p < 1 and kind == "truncated":
        note += (
            f"; with rollout.top_p={top_p} rollout.source: {name} reports the log-probs of the "
            "truncated distribution, so the mismatch includes the truncation (-log of the kept "
            "mass)"
        )
    elif top_p < 1 and kind == "untruncated":
        note += (
            f"; with rollout.top_p={top_p} the sampler reports untruncated log-probs (no "
            "truncation in the mismatch, but samples drawn from the truncated distribution)"
        )
    elif top_p < 1:
        note += (
            f"; with rollout.top_p={top_p}: whether rollout.source: {name}'s log-probs are "
            "those of the truncated distribution is not known"
        )
    return note


def mismatch_by_staleness(
    proximal_bl: torch.Tensor,
    behaviour_bl: torch.Tensor,
    mask_bl: torch.Tensor,
    ages: Sequence[int | None],
) -> dict[str, float]:
    """The train/rollout mismatch per staleness (module docstring): ``proximal_bl`` and
    ``behaviour_bl`` are the ``[B, L]`` old and rollout log-probs of the whole rollout,
    ``mask_bl`` its trained response tokens, ``ages[b]`` sample ``b``'s staleness (None: its
    version is not known, left out). Token means over each staleness' samples."""
    out: dict[str, float] = {}
    mask = mask_bl.to(torch.float64)
    proximal, behaviour = proximal_bl.to(torch.float64), behaviour_bl.to(torch.float64)
    abs_diff = (proximal - behaviour).abs()
    kl = kl_estimate(behaviour, proximal, "k3")  # k3 of (logp=behaviour, ref=proximal)
    for age in sorted({a for a in ages if a is not None}):
        rows = torch.tensor([a == age for a in ages])
        m = mask[rows]
        tokens = float(m.sum())
        key = f"mismatch/staleness_{age}"
        out[f"{key}/tokens"] = tokens
        if tokens:
            out[f"{key}/abs_diff"] = float((abs_diff[rows] * m).sum()) / tokens
            out[f"{key}/kl"] = float((kl[rows] * m).sum()) / tokens
    return out
