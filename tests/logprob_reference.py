"""The fp64 reference of per-token log-probs and entropy, with autograd's gradient, that the
log-prob tests (logits or hidden states; one process, vocabulary shards, GPU kernels) compare
with: plain ``log_softmax`` + gather, ``-sum p log p``, and the backward of
``sum(w_logp * logp) + sum(w_ent * H)`` (random upstream gradients of both outputs)."""

from __future__ import annotations

import torch


def logp_entropy_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p of ``targets``, entropy) of fp64 ``logits`` [N, V] (already divided by the
    temperature, padding columns cut), after the weighted backward through ``logits``' graph."""
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = (w_logp.double() * logp).sum()
    if w_ent is not None:
        loss = loss + (w_ent.double() * entropy).sum()
    loss.backward()
    return logp.detach(), entropy.detach()


def logits_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    vocab_size: int,
    w_logp: torch.Tensor,
    w_ent: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp64 log_softmax + gather, -sum p log p and d(sum w_logp logp + sum w_ent H)/dlogits of
    (unsharded, possibly padded) ``logits``: 0 in the padding columns."""
    x = logits.double().requires_grad_(True)
    logp, entropy = logp_entropy_backward(x[:, :vocab_size] / temperature, targets, w_logp, w_ent)
    return logp, entropy, x.grad
