"""What an advantage estimator reads: one rollout's rewards and per-token tensors, padded.

Layout: B samples, L = the longest response. Every per-token tensor is ``[B, L]`` and aligned
with ``response_mask`` (1 = a response token that counts; 0 = padding, prompt, or a masked
tool-output token inside a multi-turn response). Values outside the mask are ignored, so they
may hold anything (padding log-probs are often garbage).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch

from unirl.core.errors import LossInputError

# Optional per-token tensors, in the order they are checked.
TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "values", "teacher_logprobs", "token_rewards")


def _first_indices(bad: torch.Tensor, limit: int = 5) -> list[int]:
    return bad.nonzero().flatten()[:limit].tolist()


@attrs.frozen(kw_only=True, eq=False)
class AdvantageInputs:
    """One rollout (this rank's share of it) as an advantage estimator sees it.

    ``rewards [B]`` is the sequence-level (outcome) reward. ``token_rewards [B, L]``, when a reward
    model scores tokens, are *added* to it: token-level estimators use
    ``r_t = token_rewards_t + rewards * [t is the last valid token]``; set ``rewards`` to zeros if
    the whole reward is in ``token_rewards``. ``old_logprobs`` are the sampling (pre-step) policy's
    log-probs: the KL-in-reward shaping and on-policy distillation read them.
    """

    rewards: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B] integer: samples of one prompt share an id
    response_mask: torch.Tensor  # [B, L]
    old_logprobs: torch.Tensor | None = None  # [B, L]
    ref_logprobs: torch.Tensor | None = None  # [B, L]
    values: torch.Tensor | None = None  # [B, L] critic values V(s_t) before token t
    teacher_logprobs: torch.Tensor | None = None  # [B, L]
    token_rewards: torch.Tensor | None = None  # [B, L]

    @property
    def batch_size(self) -> int:
        return self.response_mask.shape[0]

    @property
    def mask(self) -> torch.Tensor:
        """``response_mask`` as bool."""
        return self.response_mask.bool()

    def validate(self, *, needs_groups: bool = False) -> None:
        """Check shapes, dtypes and finiteness; with ``needs_groups``, that every group has the
        same number of samples on this rank.

        Unequal groups on one rank almost always mean a group was split across ranks or samples
        were dropped, which silently corrupts a group baseline; so group-relative estimators
        refuse them. Raises `LossInputError` naming the argument and the sample indices.
        """
        mask = self.response_mask
        if mask.dim() != 2:
            raise LossInputError(
                f"response_mask must be [B, L], got shape {tuple(mask.shape)}; pad the responses "
                "to the longest one and mark real response tokens with 1"
            )
        b, length = mask.shape
        if mask.dtype != torch.bool:
            not_binary = ~((mask == 0) | (mask == 1))
            if bool(not_binary.any()):
                rows = _first_indices(not_binary.any(dim=1))
                raise LossInputError(
                    f"response_mask must hold only 0 and 1; samples {rows} have other values"
                )
        if self.rewards.shape != (b,):
            raise LossInputError(
                f"rewards must be [B]={b} (one scalar per sample, B from response_mask "
                f"{tuple(mask.shape)}), got shape {tuple(self.rewards.shape)}; put per-token "
                "rewards in token_rewards"
            )
        if not self.rewards.is_floating_point():
            raise LossInputError(f"rewards must be floating point, got {self.rewards.dtype}")
        bad = ~torch.isfinite(self.rewards)
        if bool(bad.any()):
            idx = _first_indices(bad)
            raise LossInputError(
                f"rewards must be finite; samples {idx} have {self.rewards[idx].tolist()}; "
                "fix the reward function or drop those samples from the rollout"
            )
        if self.group_ids.shape != (b,):
            raise LossInputError(
                f"group_ids must be [B]={b}, got shape {tuple(self.group_ids.shape)}"
            )
        if self.group_ids.is_floating_point() or self.group_ids.dtype == torch.bool:
            raise LossInputError(
                f"group_ids must be an integer tensor (torch.long), got {self.group_ids.dtype}"
            )
        valid = mask.bool()
        for name in TOKEN_FIELDS:
            x = getattr(self, name)
            if x is None:
                continue
            if x.shape != (b, length):
                raise LossInputError(
                    f"{name} must be [B, L]={(b, length)} like response_mask, got shape "
                    f"{tuple(x.shape)}"
                )
            bad = ~torch.isfinite(x) & valid
            if bool(bad.any()):
                rows = _first_indices(bad.any(dim=1))
                raise LossInputError(
                    f"{name} is not finite on valid response tokens of samples {rows}"
                )
        if needs_groups:
            self._check_equal_groups()

    def _check_equal_groups(self) -> None:
        ids, counts = torch.unique(self.group_ids, return_counts=True)
        if ids.numel() and bool((counts != counts[0]).any()):
            sizes = dict(zip(ids.tolist(), counts.tolist()))
            shown = dict(list(sizes.items())[:8])
            raise LossInputError(
                f"group_ids: groups have unequal sizes on this rank (group id -> samples: "
                f"{shown}{' ...' if len(sizes) > 8 else ''}; batch of {self.batch_size}). "
                "Group-relative estimators need all samples of a prompt on the same rank and the "
                "same number per prompt: split the batch over ranks by whole groups, and keep the "
                "samples-per-prompt count a divisor of the per-rank batch"
            )

    def require(self, names: Iterable[str], *, by: str) -> None:
        """Raise `LossInputError` if any optional tensor in ``names`` is missing; ``by`` says who
        needs it (an estimator name or a setting)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise LossInputError(
                f"{by} needs {', '.join(missing)} [B, L] in AdvantageInputs, got None; compute "
                "them before the advantages (forward-only passes) or change the setting"
            )
