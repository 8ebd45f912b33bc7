"""The SDK's built-in losses (``loss_fn=``), each as one of unirl's per-token policy losses
(`unirl.core.maths.losses`) summed over the datum's tokens, as the Tinker API defines them::

    cross_entropy        -sum_t w_t logp_t                                       (sft)
    importance_sampling  -sum_t r_t A_t,  r_t = exp(logp_t - q_t)                (ppo_clip, no clip)
    ppo                  -sum_t min(r_t A_t, clip(r_t, lo, hi) A_t)              (ppo_clip)
    cispo                -sum_t sg(clip(r_t, lo, hi)) logp_t A_t                 (cispo)
    dro                  -sum_t (logp_t A_t - beta/2 (logp_t - q_t)^2)          (dro)
    stable_reinforce     -sum_t s_t (logp_t A_t - c ((r_t - 1) - log r_t))     (stable_reinforce)
    gspo                 -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t)             (gspo)
                         s_t = sg(s) exp(logp_t - sg(logp_t)),
                         s = exp(mean over sequence_ratio_mask of (logp - q))

``q_t``: the sampler's log-probs (``loss_fn_inputs["logprobs"]``); ``lo`` / ``hi``:
``loss_fn_config`` ``clip_low_threshold`` / ``clip_high_threshold`` (0.8 / 1.2 by default);
``beta``: ``loss_fn_config["beta"]`` (required: the SDK documents no default); gspo's clip
thresholds are required too (the SDK documents no default for them). gspo's datums mark the
tokens of the sequence ratio (``sequence_ratio_mask``); its advantages must be 0 elsewhere, where
the API's sum over every position then adds nothing. The
RL losses sum over every position (the advantages are 0 on the prompt); cross-entropy weights
each position by ``weights`` (any float: the SDK's client-side custom loss sends the negative
gradient of its loss there). stable_reinforce reads the datum's provenance
(``Datum.with_provenance``) against what sampling recorded (`unirl.serve.stability`): ``s_t`` is
1 where the target is a sampled token, ``q_t`` the recorded sampler log-prob there, ``c``
``loss_fn_config["kl_coeff"]`` (0 by default). The sum is the API's aggregation (no
normaliser): a request's loss is the sum of its datums' losses, so requests batched together add
up exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.registry import get_policy_loss
from unirl.core.maths.losses.settings import LossSettings
from unirl.core.moe_loss import RouterLossSettings
from unirl.core.registry import Registry
from unirl.serve.errors import BadRequest

# An upper clip bound no finite ratio reaches: ppo_clip without clipping is the plain
# importance-weighted policy gradient.
_NO_CLIP = 1e30


@attrs.frozen(kw_only=True)
class SdkLoss:
    """One SDK loss: the unirl per-token loss it runs, the inputs it reads, its config keys."""

    unirl_loss: str
    inputs: tuple[str, ...]  # besides target_tokens
    clipped: bool  # reads clip_low_threshold / clip_high_threshold
    weighted: bool  # the mask is the datum's ``weights`` (else every position counts)
    penalised: bool = False  # reads beta (DRO's quadratic penalty)
    # the mask is the datum's ``sequence_ratio_mask`` (gspo: the tokens of the sequence ratio),
    # and the clip thresholds have no default
    ratio_masked: bool = False
    # reads the datum's provenance (stable_reinforce): the mask is its sampled targets, the
    # sampler's log-probs are the recorded ones (`unirl.serve.stability`); reads kl_coeff
    provenance: bool = False

    def settings(self, config: Mapping[str, float | str]) -> LossSettings:
        known = {"clip_low_threshold", "clip_high_threshold"} if self.clipped else set()
        known |= {"beta"} if self.penalised else set()
        known |= {"kl_coeff"} if self.provenance else set()
        unknown = sorted(set(config) - known)
        if unknown:
            raise BadRequest(
                "loss_fn_config", f"has unknown key(s) {unknown}; this loss takes {sorted(known)}"
            )
        if self.provenance:
            # Tinker documents the key ({"kl_coeff": 0.01}), not a default: 0, no penalty
            kl = _threshold(config, "kl_coeff", 0.0)
            if kl < 0:
                raise BadRequest("loss_fn_config.kl_coeff", f"is {kl}; it must be >= 0")
            return LossSettings(policy_loss=self.unirl_loss, stable_reinforce_kl_coef=kl)
        if self.penalised:
            if "beta" not in config:
                raise BadRequest(
                    "loss_fn_config.beta",
                    "is missing; dro needs its penalty weight (e.g. loss_fn_config={'beta': 0.05})",
                )
            beta = _threshold(config, "beta", 0.0)
            if beta < 0:
                raise BadRequest("loss_fn_config.beta", f"is {beta}; it must be >= 0")
            return LossSettings(policy_loss=self.unirl_loss, dro_beta=beta)
        if not self.clipped:
            return LossSettings(policy_loss=self.unirl_loss, clip_low=1.0, clip_high=_NO_CLIP)
        if self.ratio_masked:
            missing = [k for k in ("clip_low_threshold", "clip_high_threshold") if k not in config]
            if missing:
                raise BadRequest(
                    f"loss_fn_config.{missing[0]}",
                    "is missing; this server takes gspo's clip thresholds from the request "
                    "(e.g. {'clip_low_threshold': 0.9997, 'clip_high_threshold': 1.0004})",
                )
        low = _threshold(config, "clip_low_threshold", 0.8)
        high = _threshold(config, "clip_high_threshold", 1.2)
        if not 0.0 <= low <= 1.0 <= high:
            raise BadRequest(
                "loss_fn_config",
                f"clip_low_threshold={low} / clip_high_threshold={high} must satisfy "
                "0 <= low <= 1 <= high (e.g. 0.8 and 1.2)",
            )
        return LossSettings(policy_loss=self.unirl_loss, clip_low=1.0 - low, clip_high=high - 1.0)


def _threshold(config: Mapping[str, float | str], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, str):
        raise BadRequest(f"loss_fn_config.{key}", f"is the string {value!r}; send a number")
    number = float(value)
    if not math.isfinite(number):  # protobuf's float map carries NaN / inf: the client's mistake
        raise BadRequest(f"loss_fn_config.{key}", f"is {number}; send a finite number")
    return number


_RL_INPUTS = ("logprobs", "advantages")
SDK_LOSSES: Registry[SdkLoss] = Registry("SDK loss", key="loss_fn")
SDK_LOSSES.register(
    "cross_entropy", SdkLoss(unirl_loss="sft", inputs=("weights",), clipped=False, weighted=True)
)
SDK_LOSSES.register(
    "importance_sampling",
    SdkLoss(unirl_loss="ppo_clip", inputs=_RL_INPUTS, clipped=False, weighted=False),
)
SDK_LOSSES.register(
    "ppo", SdkLoss(unirl_loss="ppo_clip", inputs=_RL_INPUTS, clipped=True, weighted=False)
)
SDK_LOSSES.register(
    "cispo", SdkLoss(unirl_loss="cispo", inputs=_RL_INPUTS, clipped=True, weighted=False)
)
SDK_LOSSES.register(
    "gspo",
    SdkLoss(
        unirl_loss="gspo",
        inputs=(*_RL_INPUTS, "sequence_ratio_mask"),
        clipped=True,
        weighted=False,
        ratio_masked=True,
    ),
)
SDK_LOSSES.register(
    "dro",
    SdkLoss(unirl_loss="dro", inputs=_RL_INPUTS, clipped=False, weighted=False, penalised=True),
)
SDK_LOSSES.register(
    "stable_reinforce",
    SdkLoss(
        unirl_loss="stable_reinforce",
        inputs=_RL_INPUTS,  # logprobs optional: the recorded ones are used (and must agree)
        clipped=False,
        weighted=False,
        provenance=True,
    ),
)


def sdk_loss(name: str) -> SdkLoss:
    if name not in SDK_LOSSES.names():
        raise BadRequest(
            "loss_fn",
            f"is {name!r}, which this server does not run; it runs {sorted(SDK_LOSSES.names())} "
            "and forward_backward_custom (client-side)",
        )
    return SDK_LOSSES.get(name)


@attrs.frozen(kw_only=True)
class SummedLoss:
    """`unirl.core.backend.LossFn` of one batch: the per-token loss summed over the mask
    (``mb.loss_mask``: the weights, or 1 on every datum position)."""

    settings: LossSettings
    router: RouterLossSettings | None = None
    # Per microbatch, in the order the backend ran them: (log-probs, per-token loss), detached;
    # what the server hands back per datum.
    records: list[tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=list)

    def per_token(self, mb: TrainMicrobatch, logprobs: torch.Tensor) -> torch.Tensor:
        inp = LossInputs(
            logprobs=logprobs,
            advantages=mb.advantages if mb.advantages is not None else torch.zeros_like(logprobs),
            loss_mask=mb.loss_mask,
            seq_ids=mb.seq_ids,
            num_seqs=mb.num_seqs,
            seq_token_counts=mb.seq_token_counts,
            old_logprobs=mb.old_logprobs,
        )
        counts = GlobalCounts(tokens=mb.num_tokens, sequences=mb.num_seqs)
        loss_t, _ = get_policy_loss(self.settings.policy_loss)(inp, counts, self.settings)
        return loss_t * inp.mask

    def __call__(
        self,
        mb: TrainMicrobatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        /,
        *,
        router_logits: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]:
        loss_t = self.per_token(mb, logprobs)
        self.records.append((logprobs.detach(), loss_t.detach()))
        loss = loss_t.sum()
        return loss, {"loss": Metric(numerator=loss.detach(), denominator=1.0, kind="tokens")}
