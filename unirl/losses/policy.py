"""The policy, value and KL losses on right-padded ``[B, L]`` tensors.

Each call converts to the flat inputs of `unirl.core.maths.losses` and runs the same code unirl's
trainer runs (`compute_loss`, `value_loss`, `kl_estimate`, `aggregate`), so a loss computed here
equals the trainer's on the same tokens. It returns the scalar loss (with grad) and the metrics as
plain floats (each already divided by its own denominator; one host sync per call).
"""

from __future__ import annotations

import attrs
import torch

from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.kl import kl_estimate
from unirl.core.maths.losses import (
    LossInputs,
    LossSettings,
    aggregate,
    aggregate_metric,
    compute_loss,
    reduce_metrics,
    token_mean_metric,
)
from unirl.core.maths.losses import value_loss as value_loss_t
from unirl.losses.padded import check_advantages, check_mask, check_tensor, flatten, step_counts

_DEFAULT_POLICY_LOSS = attrs.fields(LossSettings).policy_loss.default


def _settings_for(name: str, settings: LossSettings | None) -> LossSettings:
    if settings is None:
        return LossSettings(policy_loss=name)
    if not isinstance(settings, LossSettings):
        raise ConfigError(
            f"policy_loss: settings must be a unirl LossSettings, got {type(settings).__name__}"
        )
    if settings.policy_loss not in (name, _DEFAULT_POLICY_LOSS):
        raise ConfigError(
            f"policy_loss: name={name!r} but settings.policy_loss={settings.policy_loss!r}; "
            "pass one loss (the name wins only over the default)"
        )
    return attrs.evolve(settings, policy_loss=name)


def _check_norm_length(settings: LossSettings, norm_length: int | None, fn: str) -> None:
    if settings.loss_aggregation == "seq-mean-token-sum-norm" and norm_length is None:
        raise LossInputError(
            f"{fn}: loss_aggregation 'seq-mean-token-sum-norm' divides by a constant length; "
            "pass norm_length= (the generation budget, e.g. max new tokens; verl's default is "
            "the padded response length L)"
        )


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    settings: LossSettings | None = None,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    global_tokens: int | torch.Tensor | None = None,
    global_sequences: int | torch.Tensor | None = None,
    norm_length: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """unirl's total policy loss (policy term, KL, entropy bonus) of one padded batch.

    - ``name``: a registered policy loss (``ppo_clip``, ``gspo``, ``cispo``, ``reinforce``,
      ``sft``, or ``"package.module:function"``).
    - ``logprobs`` ``[B, L]`` with grad; ``old_logprobs`` ``[B, L]`` or None (on-policy: the
      ratio is 1); ``advantages`` ``[B, L]`` or ``[B]``; ``mask`` ``[B, L]`` bool or 0/1.
    - ``settings``: clip bounds, dual clip, aggregation, KL / entropy coefficients, rollout
      correction (default: `LossSettings`'s defaults: clip 0.2 / 0.2, token-mean).
    - ``global_tokens`` / ``global_sequences``: counts of the whole optimizer step (default: this
      batch's own; see `unirl.losses.padded`). ``norm_length``: seq-mean-token-sum-norm's constant.
    - ``is_weights``: a per-token weight of the policy-gradient term computed elsewhere (verl's
      ``rollout_is_weights``); unirl's own correction is ``settings.rollout_correction``.
    """
    fn = "policy_loss"
    settings = _settings_for(name, settings)
    m = check_mask(mask, fn=fn)
    shape = tuple(m.shape)
    tensors = {
        "logprobs": check_tensor("logprobs", logprobs, shape, fn=fn),
        "advantages": check_advantages(advantages, shape, fn=fn),
    }
    for arg, x in (
        ("old_logprobs", old_logprobs),
        ("rollout_logprobs", rollout_logprobs),
        ("ref_logprobs", ref_logprobs),
        ("entropy", entropy),
        ("is_weights", is_weights),
    ):
        tensors[arg] = None if x is None else check_tensor(arg, x, shape, fn=fn)
    _check_norm_length(settings, norm_length, fn)
    counts = step_counts(m, global_tokens, global_sequences, norm_length, fn=fn)
    flat, flat_mask, seq_ids, seq_counts = flatten(m, tensors)
    is_flat = flat.pop("is_weights")
    inp = LossInputs(
        loss_mask=flat_mask, seq_ids=seq_ids, num_seqs=shape[0], seq_token_counts=seq_counts, **flat
    )  # type: ignore[arg-type]
    out = compute_loss(inp, counts, settings, pg_weight=is_flat)
    return out.loss, reduce_metrics([out.metrics])


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_values: torch.Tensor | None = None,
    settings: LossSettings | None = None,
    global_tokens: int | torch.Tensor | None = None,
    global_sequences: int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss ``0.5 max((v - R)^2, (v_clip - R)^2)``, aggregated.

    ``settings.value_clip`` is the clip range (None: unclipped) and ``settings.loss_aggregation``
    the aggregation; ``value_coef`` is NOT applied (it weighs this term in a total, as unirl's
    trainer does). ``old_values`` None means on-policy (nothing is clipped).
    """
    fn = "value_loss"
    settings = LossSettings() if settings is None else settings
    m = check_mask(mask, fn=fn)
    shape = tuple(m.shape)
    tensors = {
        "values": check_tensor("values", values, shape, fn=fn),
        "returns": check_tensor("returns", returns, shape, fn=fn),
        "old_values": None
        if old_values is None
        else check_tensor("old_values", old_values, shape, fn=fn),
    }
    _check_norm_length(settings, norm_length, fn)
    counts = step_counts(m, global_tokens, global_sequences, norm_length, fn=fn)
    flat, flat_mask, seq_ids, seq_counts = flatten(m, tensors)
    v = flat["values"]
    assert v is not None and flat["returns"] is not None
    # The aggregation reads only the mask, sequence ids and dtype; the values stand in as "logprobs".
    inp = LossInputs(
        logprobs=v,
        advantages=torch.zeros_like(v),
        loss_mask=flat_mask,
        seq_ids=seq_ids,
        num_seqs=shape[0],
        seq_token_counts=seq_counts,
        values=v,
        returns=flat["returns"],
        old_values=flat["old_values"],
    )
    inp.validate()
    v_t, clipped = value_loss_t(v, inp.returns, inp.old_values, settings.value_clip)
    mode = settings.loss_aggregation
    metrics = {
        "value_loss": aggregate_metric(v_t, inp, counts, mode),
        "vf_clipfrac": token_mean_metric(clipped, inp.mask),
    }
    return aggregate(v_t, inp, counts, mode), reduce_metrics([metrics])


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    estimator: str | None = None,
    settings: LossSettings | None = None,
    global_tokens: int | torch.Tensor | None = None,
    global_sequences: int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The KL(policy || reference) estimate, aggregated like unirl's KL loss term.

    ``estimator``: ``k1``, ``k2``, ``k3``, ``low_var_kl`` or ``k3+`` (default
    ``settings.kl_loss_estimator``); ``kl_loss_coef`` is NOT applied. Metrics: ``kl_loss`` (the
    aggregated value) and ``kl`` (mean over valid tokens).
    """
    fn = "kl_loss"
    settings = LossSettings() if settings is None else settings
    estimator = settings.kl_loss_estimator if estimator is None else estimator
    m = check_mask(mask, fn=fn)
    shape = tuple(m.shape)
    tensors = {
        "logprobs": check_tensor("logprobs", logprobs, shape, fn=fn),
        "ref_logprobs": check_tensor("ref_logprobs", ref_logprobs, shape, fn=fn),
    }
    _check_norm_length(settings, norm_length, fn)
    counts = step_counts(m, global_tokens, global_sequences, norm_length, fn=fn)
    flat, flat_mask, seq_ids, seq_counts = flatten(m, tensors)
    inp = LossInputs(
        advantages=torch.zeros_like(flat["logprobs"]),
        loss_mask=flat_mask,
        seq_ids=seq_ids,
        num_seqs=shape[0],
        seq_token_counts=seq_counts,
        **flat,  # type: ignore[arg-type]
    )
    inp.validate()
    kl_t = kl_estimate(inp.logprobs, inp.ref_logprobs, estimator)
    mode = settings.loss_aggregation
    metrics = {
        "kl_loss": aggregate_metric(kl_t, inp, counts, mode),
        "kl": token_mean_metric(kl_t, inp.mask),
    }
    return aggregate(kl_t, inp, counts, mode), reduce_metrics([metrics])
