"""The router's auxiliary losses of a mixture-of-experts model, and how they enter the RL loss.

Two terms over the router logits ``l`` of every MoE layer of one forward (rows: tokens x layers,
``E`` experts, top-``k`` routing), as Qwen3-MoE trains with them:

- load balancing (Switch Transformer, arXiv:2101.03961, eqs. 4-6; Hugging Face's
  ``load_balancing_loss_func``): the rows of all layers are pooled, then
  ``aux = E * sum_e f_e * P_e`` with ``f_e`` the top-k assignments to expert ``e`` per row (the
  ``f_e`` sum to ``k``) and ``P_e`` the mean softmax probability of ``e``. Only ``P`` carries a
  gradient (the top-k choice is discrete).
- z-loss (ST-MoE, arXiv:2202.08906, eq. 5): ``z = mean over rows of logsumexp(l)^2``.

Rows are the tokens the router saw: pass the logits of real tokens only (drop padding rows),
which is what Hugging Face computes when it is given the attention mask.

**Across microbatches and data-parallel ranks.** The loss library's rule is that the local
losses summed over every microbatch and every DP x CP rank equal the step objective. ``aux`` and
``z`` are not sums over tokens: ``aux`` is a product of two means over the rows of one forward,
so it cannot be split into per-token shares. Each forward's ``aux`` / ``z`` is what Hugging Face
computes for that forward's batch, and the step objective is their token-weighted mean::

    router term of microbatch m = (aux_coef * aux_m + z_coef * z_m) * n_m / N

with ``n_m`` the routed tokens of the microbatch on this rank and ``N`` those of the whole step
(every microbatch of every rank: the plan's ``sum(step.rank_microbatch_tokens)``, so no
collective is needed). Why this weighting: with one microbatch on one rank it is exactly Hugging
Face's term for the batch (the contract's reference); it does not change with the number of
microbatches or ranks when they are of equal size; a short microbatch counts for its tokens, not
as much as a long one (a plain mean over microbatches would); and it is already a rank-local share
of a global sum, so each backend's one scale factor applies to it unchanged, as to the policy
loss. The balance statistic itself stays per forward (as in Hugging Face and Megatron), so the
term differs from the ``aux`` of the whole step's rows pooled when microbatches route differently.

**A forward split across ranks.** A context-parallel rank holds a chunk of each sequence and a
pipeline stage only its own layers, so `router_losses` on their local logits is not the
forward's pooled value (two stages' ``aux`` summed is about twice the model's). Exact there: each
part computes `router_statistics` of its logits, the backend sums ``assignments_e`` and ``rows``
over the parts (one all-reduce, no gradient: the top-k choice has none), and `router_loss_shares`
gives each part its share, linear in its own probabilities, so the shares add up to the pooled
``aux`` and ``z`` and so do their gradients. Each part then calls `router_loss_term` with its
shares, the whole microbatch's tokens and ``part=rows / total rows``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import KeyedConfigError, LossInputError
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.total import LossOutput


def _coefficient(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        ok = False
    else:
        ok = value >= 0
    if not ok:
        raise KeyedConfigError(
            lambda key: (
                f"{key(attribute.name)}={value!r} must be a finite number >= 0 (0 leaves the "
                "term out)"
            ),
            lambda field: f"RouterCoefficients.{field}",
        )


@attrs.frozen(kw_only=True)
class RouterCoefficients:
    """The weights of the two router terms in the loss (the one source of their defaults; the
    config keys ``algorithm.router_aux_loss_coef`` / ``router_z_loss_coef`` feed them).
    0.001: Qwen3-MoE's own ``router_aux_loss_coef``; the z-loss is off unless asked for."""

    aux_coef: float = attrs.field(default=0.001, validator=_coefficient)
    z_coef: float = attrs.field(default=0.0, validator=_coefficient)


@attrs.frozen(kw_only=True, eq=False)
class RouterStatistics:
    """The sums over the rows of some MoE layers' router logits that ``aux`` and ``z`` are made
    of (so that the parts of a forward split across ranks can be pooled exactly)."""

    assignments_e: torch.Tensor  # [E] top-k assignments per expert, fp32, no gradient
    prob_sum_e: torch.Tensor  # [E] summed softmax probabilities, fp32, with gradient
    lse_sq_sum: torch.Tensor  # scalar: summed logsumexp(logits)^2, fp32, with gradient
    rows: int


def router_statistics(
    router_logits: Sequence[torch.Tensor], *, top_k: int, num_experts: int
) -> RouterStatistics:
    """`RouterStatistics` of each MoE layer's router logits ``[..., num_experts]``, computed in
    fp32 (Hugging Face takes the softmax in the logits' dtype: the same values for fp32)."""
    if not router_logits:
        raise LossInputError("router_losses needs the router logits of at least one MoE layer")
    if not 1 <= top_k <= num_experts:
        raise LossInputError(
            f"router_losses: top_k={top_k} must be between 1 and num_experts={num_experts}"
        )
    device = router_logits[0].device
    assignments_e = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum_e = torch.zeros(num_experts, dtype=torch.float32, device=device)
    lse_sq_sum = torch.zeros((), dtype=torch.float32, device=device)
    rows = 0
    for layer, logits in enumerate(router_logits):
        if logits.shape[-1] != num_experts:
            raise LossInputError(
                f"router_losses: the logits of MoE layer {layer} have shape "
                f"{tuple(logits.shape)}, expected [..., num_experts={num_experts}]"
            )
        logits_re = logits.reshape(-1, num_experts).float()
        probs_re = torch.softmax(logits_re, dim=-1)
        chosen = torch.topk(probs_re, top_k, dim=-1).indices  # top-k of the probabilities, as HF
        # counts by scatter_add (exact in fp32 below 2**24 rows), not bincount: on CUDA
        # bincount reads the largest index back to the host, a sync per MoE layer
        flat = chosen.reshape(-1)
        assignments_e = assignments_e.scatter_add(
            0, flat, torch.ones(flat.shape, dtype=torch.float32, device=device)
        )
        prob_sum_e = prob_sum_e + probs_re.sum(dim=0)
        lse_sq_sum = lse_sq_sum + torch.logsumexp(logits_re, dim=-1).square().sum()
        rows += logits_re.shape[0]
    return RouterStatistics(
        assignments_e=assignments_e, prob_sum_e=prob_sum_e, lse_sq_sum=lse_sq_sum, rows=rows
    )


def router_loss_shares(
    local: RouterStatistics, *, assignments_e: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This part's shares of ``(aux, z)``, given the ``assignments_e`` and ``rows`` summed over
    every part of the forward: ``E * sum_e (A_e / R) (S_e / R)`` and ``lse_sq_sum / R``, with
    ``S_e`` this part's probability sums. No rows at all: both 0."""
    # Both means are over the pooled rows of all layers (HF's total_rows), not per layer.
    n = max(rows, 1)
    num_experts = assignments_e.shape[0]
    aux = num_experts * torch.sum((assignments_e.detach() / n) * (local.prob_sum_e / n))
    return aux, local.lse_sq_sum / n


def router_losses(
    router_logits: Sequence[torch.Tensor], *, top_k: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(aux, z)`` of one forward from each MoE layer's router logits ``[..., num_experts]``
    (the rows of every layer pooled, as Hugging Face's ``load_balancing_loss_func`` without an
    attention mask), in fp32. No rows: both are 0."""
    stats = router_statistics(router_logits, top_k=top_k, num_experts=num_experts)
    return router_loss_shares(stats, assignments_e=stats.assignments_e, rows=stats.rows)


def router_loss_term(
    aux: torch.Tensor,
    z: torch.Tensor,
    *,
    aux_coef: float,
    z_coef: float,
    microbatch_tokens: int,
    global_tokens: int,
    part: float = 1.0,
) -> LossOutput:
    """This microbatch's share of the step's router term (add its ``loss`` to the policy loss
    before the backend's scale factor) and the metrics ``router/aux_loss`` and
    ``router/z_loss``: the token-weighted means of ``aux`` and ``z`` over the step's forwards,
    unweighted by the coefficients. ``microbatch_tokens``: the routed tokens of this microbatch
    on this rank; ``global_tokens``: those of the whole step (see the module docstring).
    ``part``: for ``aux`` / ``z`` that are one part's `router_loss_shares` of a forward split
    across ranks, that part's ``rows / total rows`` (the shares' ``microbatch_tokens`` is then the
    whole microbatch's), so that the parts' metric weights add up to the microbatch's."""
    if not 0.0 <= part <= 1.0:
        raise LossInputError(f"router_loss_term: part={part} must be between 0 and 1")
    if microbatch_tokens < 0 or global_tokens < microbatch_tokens:
        raise LossInputError(
            f"router_loss_term: microbatch_tokens={microbatch_tokens} must be between 0 and "
            f"global_tokens={global_tokens} (the routed tokens of the whole step)"
        )
    # The token share of the step, so that the shares of all microbatches and ranks sum to the
    # token-weighted mean (an empty step: zero, not NaN).
    share = microbatch_tokens / max(global_tokens, 1)
    loss = (aux_coef * aux + z_coef * z) * share
    # Numerator aux * n over denominator n: summed over microbatches and ranks, then divided
    # once, this is the same token-weighted mean the loss term uses. The parts of a split
    # forward each bring their share of aux with the whole n, and part of the denominator.
    weight = microbatch_tokens * part
    metrics = {
        "router/aux_loss": Metric(
            numerator=aux.detach() * microbatch_tokens, denominator=weight, kind="tokens"
        ),
        "router/z_loss": Metric(
            numerator=z.detach() * microbatch_tokens, denominator=weight, kind="tokens"
        ),
    }
    return LossOutput(loss=loss, metrics=metrics)
