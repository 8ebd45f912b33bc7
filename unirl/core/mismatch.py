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
"""

from __future__ import annotations

from unirl.core.run.config import UnirlConfig
from unirl.core.source_plugin import SOURCES


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
