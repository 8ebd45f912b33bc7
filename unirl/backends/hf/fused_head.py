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

In the training forward of a loss separable over tokens (``spec.loss_in_head``, decided by core)
the request also carries the microbatch and core's loss, and the head computes the LOSS itself
(`token_loss_from_hidden`: three head matmuls, the gradients of the hidden states and of the
weight made in the forward, while the engine has the weight whole); `training_loss` returns it
with its metrics and the detached log-probs. The loss leaves the head as the output's last column
(every entry is the loss; the loop differentiates entry ``[0, -1]``), so the engine's hooks on the
module outputs (ZeRO-3's pre-backward gather, FSDP2's root pre-backward and its reduce-scatter
callback) run as for logits.

Outside a request the head is a plain ``nn.Linear`` (generation, export, anything else).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

from unirl.core.backend import (
    LossFn,
    token_logprobs,
    token_logprobs_from_hidden,
    token_loss_from_hidden,
)
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.errors import ConfigError
from unirl.core.maths.head_loss import HeadLossOutput
from unirl.core.maths.logprob_spec import LogprobSpec


@attrs.define
class _Request:
    targets: torch.Tensor
    spec: LogprobSpec
    # the loss inside the head: core's loss of this microbatch, and what the forward made of it
    loss_fn: LossFn | None = None
    mb: TrainMicrobatch | None = None
    result: HeadLossOutput | None = None


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

    @contextlib.contextmanager
    def loss_request(
        self, mb: TrainMicrobatch, spec: LogprobSpec, loss_fn: LossFn
    ) -> Iterator[_Request]:
        """Forwards in this block compute ``loss_fn`` of ``mb`` inside the head (a separable
        loss only) and return ``[1, T, 2 or 3]``: log-prob, entropy, the loss; the request's
        ``result`` then holds the loss, its metrics and the detached log-probs."""
        req = _Request(mb.targets, spec, loss_fn, mb)
        self._fused_request = req
        try:
            yield req
        finally:
            self._fused_request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self._fused_request
        if req is None:
            return super().forward(hidden)
        hidden_th = hidden.reshape(-1, hidden.shape[-1]).to(self.weight.dtype)
        if req.loss_fn is not None:
            assert req.mb is not None
            req.result = res = token_loss_from_hidden(
                hidden_th, self.weight, req.mb, req.spec, req.loss_fn
            )
            cols = [res.logprobs] + ([] if res.entropy is None else [res.entropy])
            cols.append(res.loss.expand(hidden_th.shape[0]))
            return torch.stack(cols, dim=-1)[None]
        logp, entropy = token_logprobs_from_hidden(hidden_th, self.weight, req.targets, req.spec)
        cols = [logp] if entropy is None else [logp, entropy]
        return torch.stack(cols, dim=-1)[None]


# Config keys by which a family transforms its logits after the head's matmul (Gemma's
# softcapping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, ...)
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier_scale",
    "logits_scaling",
    "lm_head_multiplier",
)


def head_problem(model: Any) -> str | None:
    """Why ``model``'s logits are more than its output embedding's ``h @ W.T`` (None: they are
    exactly that)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"its output embedding is {type(head).__name__}, not a torch.nn.Linear"
    if head.bias is not None:
        return "its LM head has a bias"
    for key in _LOGIT_TRANSFORMS:
        if getattr(model.config, key, None) not in (None, 1.0):
            return f"it transforms its logits ({key}={getattr(model.config, key)!r})"
    return None


def install_fused_head(model: Any) -> FusedLMHead:
    """Turn ``model``'s output embedding (``lm_head``) into a `FusedLMHead` in place (same
    parameters and state-dict keys); refuses heads whose logits are more than ``h @ W.T``."""
    problem = head_problem(model)
    if problem is not None:
        raise ConfigError(
            f"model.fused_head: {type(model).__name__}: {problem}, which the fused log-probs do "
            "not reproduce; set model.fused_head: false for this model"
        )
    head = model.get_output_embeddings()
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


def training_loss(
    forward: Callable[[TrainMicrobatch], torch.Tensor],
    head: FusedLMHead,
    mb: TrainMicrobatch,
    spec: LogprobSpec,
    loss_fn: LossFn,
) -> tuple[HeadLossOutput, torch.Tensor]:
    """``loss_fn`` of one microbatch with tokens, computed inside the fused head (``mb.num_tokens
    > 0``; ``spec.loss_in_head``): ``(result, output)``, where ``result.loss`` is the output's
    loss entry (autograd runs through the model's output, as for logits) and ``output`` what
    ``forward`` returned."""
    with head.loss_request(mb, spec, loss_fn) as req:
        out = forward(mb)
    res = req.result
    if res is None:
        raise RuntimeError(
            "model.fused_head: the model's forward did not call its LM head inside the loss "
            "request (a model whose forward skips lm_head cannot take the loss into the head)"
        )
    loss = out[0, -1]
    return attrs.evolve(res, loss=loss), out
