"""``model.fused_head`` for Hugging Face causal LMs (the DeepSpeed and FSDP2 backends): the LM
head hands its input (the final hidden states) and its weight to core's
`token_logprobs_from_hidden` instead of making the ``[T, V]`` logits.

The log-probs are computed inside the head's own forward, which is where every engine makes the
head's weight whole: ZeRO-3 gathers it in the head's pre-forward hook (and again before the
head's backward), FSDP2 unshards it with the root module. The head then returns the per-token
log-probs (and entropy) in place of logits, ``[1, T, 1]`` or ``[1, T, 2]``, and the model's
output carries them in ``.logits``::

    head = install_fused_head(model)                   # once, before the engine wraps the model
    with head.request(targets, spec):
        out = model(input_ids=..., ...).logits[0]       # [T, 1 or 2]: log-prob, entropy
    logp, entropy = split_head_output(out, spec)

Outside a request the head is a plain ``nn.Linear`` (generation, export, anything else).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from unirl.core.backend import token_logprobs, token_logprobs_from_hidden
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.errors import ConfigError
from unirl.core.maths.logprob_spec import LogprobSpec


@attrs.frozen
class _Request:
    targets: torch.Tensor
    spec: LogprobSpec


class FusedLMHead(torch.nn.Linear):
    """An ``nn.Linear`` LM head that, inside `request`, returns log-probs instead of logits."""

    _fused_request: _Request | None = None

    @contextlib.contextmanager
    def request(self, targets_t: torch.Tensor, spec: LogprobSpec) -> Iterator[None]:
        """Forwards in this block return ``[1, T, 1 or 2]`` (log-prob, entropy) for
        ``targets_t [T]`` (one per input position)."""
        self._fused_request = _Request(targets_t, spec)
        try:
            yield
        finally:
            self._fused_request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self._fused_request
        if req is None:
            return super().forward(hidden)
        hidden_th = hidden.reshape(-1, hidden.shape[-1])
        logp, entropy = token_logprobs_from_hidden(
            hidden_th.to(self.weight.dtype), self.weight, req.targets, req.spec
        )
        cols = [logp] if entropy is None else [logp, entropy]
        return torch.stack(cols, dim=-1)[None]


def install_fused_head(model: Any) -> FusedLMHead:
    """Turn ``model``'s output embedding (``lm_head``) into a `FusedLMHead` in place (same
    parameters and state-dict keys); refuses heads whose logits are more than ``h @ W.T``."""
    head = model.get_output_embeddings()
    name = type(model).__name__
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(
            f"model.fused_head: {name}'s output embedding is {type(head).__name__}, not a "
            "torch.nn.Linear; set model.fused_head: false for this model"
        )
    if head.bias is not None:
        raise ConfigError(
            f"model.fused_head: {name}'s LM head has a bias, which the fused log-probs do not "
            "add; set model.fused_head: false for this model"
        )
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(model.config, key, None) not in (None, 1.0):
            raise ConfigError(
                f"model.fused_head: {name} transforms its logits ({key}="
                f"{getattr(model.config, key)!r}); set model.fused_head: false for this model"
            )
    if not isinstance(head, FusedLMHead):
        head.__class__ = FusedLMHead
    return head


def split_head_output(
    out_t2: torch.Tensor, spec: LogprobSpec
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs ``[T]``, entropy ``[T]`` or None) from a fused head's ``[T, 1 or 2]``."""
    return out_t2[:, 0], (out_t2[:, 1] if spec.with_entropy else None)


def packed_logprobs(
    forward: Callable[[TrainMicrobatch], torch.Tensor],
    head: FusedLMHead | None,
    mb: TrainMicrobatch,
    spec: LogprobSpec,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(logp [T], entropy [T] or None, output)`` of one packed microbatch, where ``forward(mb)``
    runs the model and returns ``.logits[0]`` (one pad token for an empty microbatch, as the
    engines need); ``output`` is what that returned, for `zero_through_graph`. With a ``head``
    the log-probs come from the fused head, else from the logits (`token_logprobs`)."""
    empty = mb.num_tokens == 0
    if head is None:
        logits = forward(mb)
        logp, entropy = token_logprobs(logits[:0] if empty else logits, mb.targets, spec)
        return logp, entropy, logits
    # the pad token of an empty microbatch predicts id 0; its log-prob is dropped below
    targets = mb.targets.new_zeros(1) if empty else mb.targets
    with head.request(targets, spec):
        out = forward(mb)
    logp, entropy = split_head_output(out[:0] if empty else out, spec)
    return logp, entropy, out
