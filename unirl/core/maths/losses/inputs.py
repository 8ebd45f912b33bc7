"""The per-token tensors of one microbatch on one rank, as the loss library receives them.

Everything is flat over the microbatch's local tokens (``[T]``; packed sequences, padding
included with ``loss_mask`` 0). Sequence structure travels with them: ``seq_ids`` maps each token
to its local sequence, and ``seq_token_counts`` holds each sequence's GLOBAL valid-token count —
under context parallel a sequence's tokens are split over the CP ranks, so a local count would
give every rank a different (wrong) length normalisation.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from unirl.core.errors import LossInputError

# The three roles of the log-probs in an (off-policy) PPO step -> the field that holds each.
LOGPROB_ROLES = {
    "current": "logprobs",
    "proximal": "old_logprobs",
    "behaviour": "rollout_logprobs",
}

# Per-token tensors that must be finite wherever they are given.
_FINITE_FIELDS = (
    "logprobs",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
    "advantages",
    "entropy",
    "values",
    "old_values",
    "returns",
)


@attrs.frozen(kw_only=True, eq=False)
class LossInputs:
    """Per-token inputs of one microbatch on this rank.

    The log-probs play three roles (`LOGPROB_ROLES`):

    - current: ``logprobs``, the training forward's, with grad;
    - proximal: ``old_logprobs``, the policy the PPO ratio is clipped against (the "old" one);
      None means "reuse": the policy has not moved since the rollout was scored, so the
      pre-step log-probs are this forward's own, detached (ratio exactly 1);
    - behaviour: ``rollout_logprobs``, the rollout engine's, of the policy that generated the
      tokens (maybe some optimizer steps old). Rollout correction (TIS, IcePop) and decoupled
      PPO weight tokens by proximal / behaviour.
    Padding tokens need ``loss_mask`` 0 and any valid ``seq_ids`` entry.
    """

    logprobs: torch.Tensor  # [T], with grad
    advantages: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T], bool or float 0/1
    seq_ids: torch.Tensor  # [T] long, local sequence index 0..num_seqs-1
    num_seqs: int
    seq_token_counts: torch.Tensor  # [num_seqs], GLOBAL valid tokens of each sequence
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    cp_group: Any = None  # context-parallel group; None = sequences are whole on this rank

    @property
    def mask(self) -> torch.Tensor:
        """The loss mask as a float tensor in the log-probs' dtype."""
        return self.loss_mask.to(self.logprobs.dtype)

    @property
    def behaviour_logprobs(self) -> torch.Tensor | None:
        """The behaviour policy's log-probs (the rollout engine's), or None when not given."""
        return self.rollout_logprobs

    def proximal_logprobs(self) -> torch.Tensor:
        """The proximal policy's log-probs (the PPO ratio's "old"), detached-reuse resolved."""
        return self.resolved_old_logprobs()

    def resolved_old_logprobs(self) -> torch.Tensor:
        """Pre-step log-probs; ``None`` means reuse this forward's own, detached."""
        return self.logprobs.detach() if self.old_logprobs is None else self.old_logprobs

    def validate(self) -> None:
        """Raise `LossInputError` naming the argument for a shape, dtype or value mistake.

        Shapes are checked without touching the device; the value checks (finite tensors,
        sequence ids in range, local valid tokens within the global counts) are fused into one
        host sync.
        """
        lp = self.logprobs
        if lp.dim() != 1 or not lp.dtype.is_floating_point:
            raise LossInputError(
                f"LossInputs.logprobs must be a flat floating tensor [T], got shape "
                f"{tuple(lp.shape)} dtype {lp.dtype}; flatten the microbatch's tokens first"
            )
        n = lp.shape[0]
        for name in ("advantages", "loss_mask", "seq_ids", *_FINITE_FIELDS[1:]):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise LossInputError(
                    f"LossInputs.{name} has shape {tuple(t.shape)}, expected ({n},) like "
                    f"logprobs; every per-token tensor must cover the same {n} tokens"
                )
        if self.seq_ids.dtype != torch.long:
            raise LossInputError(
                f"LossInputs.seq_ids must be int64 (torch.long), got {self.seq_ids.dtype}"
            )
        if self.loss_mask.dtype != torch.bool and not self.loss_mask.dtype.is_floating_point:
            raise LossInputError(
                f"LossInputs.loss_mask must be bool or float, got {self.loss_mask.dtype}"
            )
        if self.num_seqs < 0 or tuple(self.seq_token_counts.shape) != (self.num_seqs,):
            raise LossInputError(
                f"LossInputs.seq_token_counts has shape {tuple(self.seq_token_counts.shape)}, "
                f"expected (num_seqs,) = ({self.num_seqs},): one global count per local sequence"
            )

        checks: list[tuple[str, torch.Tensor]] = []
        for name in _FINITE_FIELDS:
            t = getattr(self, name)
            if t is not None:
                checks.append((name, torch.isfinite(t).all()))
        if n > 0:
            in_range = (self.seq_ids >= 0).all() & (self.seq_ids < self.num_seqs).all()
            checks.append(("seq_ids", in_range))
        if n > 0 and self.num_seqs > 0:
            # Clamped so a bad id reports through the seq_ids check instead of crashing here.
            ids = self.seq_ids.clamp(0, self.num_seqs - 1)
            local = torch.zeros(self.num_seqs, dtype=lp.dtype, device=lp.device)
            local = local.index_add(0, ids, self.mask.detach())
            checks.append(("seq_token_counts", (local <= self.seq_token_counts.to(lp.dtype)).all()))
        if not checks:
            return
        ok = torch.stack([c for _, c in checks])
        if bool(ok.all()):  # the one host sync on the good path
            return
        name = checks[int((~ok).nonzero()[0])][0]
        raise LossInputError(self._explain(name))

    def _explain(self, name: str) -> str:
        if name == "seq_ids":
            lo, hi = int(self.seq_ids.min()), int(self.seq_ids.max())
            return (
                f"LossInputs.seq_ids must lie in [0, num_seqs={self.num_seqs}), got values in "
                f"[{lo}, {hi}]; number the microbatch's sequences locally from 0"
            )
        if name == "seq_token_counts":
            local = torch.zeros(self.num_seqs, dtype=self.logprobs.dtype).index_add(
                0, self.seq_ids.cpu(), self.mask.detach().cpu()
            )
            bad = int((local > self.seq_token_counts.cpu().to(local.dtype)).nonzero()[0])
            return (
                f"LossInputs.seq_token_counts[{bad}]={int(self.seq_token_counts[bad])} is smaller "
                f"than the {int(local[bad])} valid tokens of sequence {bad} in this microbatch; "
                "pass the GLOBAL valid-token count of each sequence (over all CP ranks)"
            )
        t = getattr(self, name)
        bad_t = ~torch.isfinite(t.detach())
        first = int(bad_t.nonzero()[0])
        return (
            f"LossInputs.{name} has {int(bad_t.sum())} non-finite value(s) (NaN or inf) out of "
            f"{t.numel()} tokens, first at token {first} (value {float(t[first])}); fix the "
            f"producer of {name} (a NaN here would silently poison the gradient)"
        )
