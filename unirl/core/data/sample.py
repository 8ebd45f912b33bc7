"""One rollout sample: a prompt, a sampled response, its reward and group, and optional per-token
data (the rollout data contract is described in `unirl.core.data.rollout`)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from unirl.core.data.routed_experts import convert_routed_experts
from unirl.core.data.sample_fields import (
    OPTIONAL_FIELDS,
    PER_TOKEN_FLOAT_FIELDS,
    REQUIRED_FIELDS,
    _convert_group_id,
    _convert_loss_mask,
    _convert_metadata,
    _convert_policy_version,
    _convert_reward,
    _describe,
    _float_converter,
    _tensor_eq,
    _token_converter,
)
from unirl.core.errors import RolloutDataError


@attrs.frozen(kw_only=True, unsafe_hash=False)
class RolloutSample:
    """One prompt, one sampled response, its reward and group, and optional per-token data.

    Construction normalises types (token ids to 1-D int64, masks to bool, float fields to
    float32, all on the CPU) and raises `RolloutDataError` naming the field for a value of the
    wrong type; `RolloutBatch.validate` checks everything that depends on the model or on other
    fields. A missing ``loss_mask`` means "train on every response token".
    """

    prompt_tokens: torch.Tensor = attrs.field(
        converter=_token_converter("prompt_tokens"), eq=_tensor_eq
    )
    response_tokens: torch.Tensor = attrs.field(
        converter=_token_converter("response_tokens"), eq=_tensor_eq
    )
    reward: float = attrs.field(converter=_convert_reward)
    group_id: int = attrs.field(converter=_convert_group_id)
    loss_mask: torch.Tensor = attrs.field(default=None, converter=_convert_loss_mask, eq=_tensor_eq)
    rollout_logprobs: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("rollout_logprobs"), eq=_tensor_eq
    )
    ref_logprobs: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("ref_logprobs"), eq=_tensor_eq
    )
    values: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("values"), eq=_tensor_eq
    )
    # The part of ``reward`` earned at each response token (a multi-turn episode's per-turn
    # rewards on each turn's last token, 0 elsewhere): token-level estimators (reinforce_pp,
    # gae) credit it there and take ``reward - sum(token_rewards)`` as the outcome at the last
    # token; sequence-level ones (grpo, rloo) use ``reward`` alone, so it must be the total.
    token_rewards: torch.Tensor | None = attrs.field(
        default=None, converter=_float_converter("token_rewards"), eq=_tensor_eq
    )
    # [prompt + response - 1, moe_layers, top_k] int32 (`unirl.core.data.routed_experts`).
    routed_experts: torch.Tensor | None = attrs.field(
        default=None, converter=convert_routed_experts, eq=_tensor_eq
    )
    # The optimizer-step count of the weights that generated the response; None: unknown.
    policy_version: int | None = attrs.field(default=None, converter=_convert_policy_version)
    metadata: dict[str, Any] = attrs.field(factory=dict, converter=_convert_metadata)

    def __attrs_post_init__(self) -> None:
        if self.loss_mask is None:
            ones = torch.ones(self.response_tokens.numel(), dtype=torch.bool)
            object.__setattr__(self, "loss_mask", ones)

    @property
    def prompt_length(self) -> int:
        return self.prompt_tokens.numel()

    @property
    def response_length(self) -> int:
        return self.response_tokens.numel()

    @property
    def length(self) -> int:
        return self.prompt_length + self.response_length

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> RolloutSample:
        """Build from a dict of plain values (one JSONL line); errors name the field only, the
        caller adds the sample index or line number."""
        if not isinstance(record, Mapping):
            raise RolloutDataError(
                f"record is {_describe(record)}; give a dict with fields {', '.join(REQUIRED_FIELDS)}"
            )
        known = REQUIRED_FIELDS + OPTIONAL_FIELDS
        for key in record:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean '{close[0]}'? " if close else ""
                raise RolloutDataError(
                    f"unknown field {key!r}; {hint}known fields are {', '.join(known)}"
                )
        for key in REQUIRED_FIELDS:
            if key not in record or record[key] is None:
                raise RolloutDataError(
                    f"missing required field '{key}' (every sample needs "
                    f"{', '.join(REQUIRED_FIELDS)})"
                )
        return cls(**{k: v for k, v in record.items() if v is not None})

    def to_record(self) -> dict[str, Any]:
        """Plain JSON-ready values; optional fields that are absent are left out."""
        record: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens.tolist(),
            "response_tokens": self.response_tokens.tolist(),
            "reward": self.reward,
            "group_id": self.group_id,
            "loss_mask": self.loss_mask.to(torch.int64).tolist(),
        }
        for name in PER_TOKEN_FLOAT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                record[name] = value.tolist()
        if self.routed_experts is not None:
            record["routed_experts"] = self.routed_experts.tolist()
        if self.policy_version is not None:
            record["policy_version"] = self.policy_version
        if self.metadata:
            record["metadata"] = self.metadata
        return record
