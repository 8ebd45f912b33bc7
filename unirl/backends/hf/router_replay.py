"""Routing replay on a Hugging Face mixture-of-experts model (DeepSpeed, FSDP2): record each MoE
layer's top-k experts per token, or replace them with given ones.

Where the choice is made. In transformers' Qwen3-MoE (5.x) every sparse block calls its router,
`Qwen3MoeTopKRouter`, which returns ``(router_logits, routing_weights, router_indices)``:
``p = softmax(logits)`` in fp32, ``topk(p, k)``, the k values divided by their sum when
``norm_topk_prob``, cast to the logits' dtype; the fused experts module then computes
``sum_k w_k * expert_{i_k}(x)`` from exactly those indices and weights. A forward hook on the
router replaces its output, so no transformers code is patched:

- **record**: the indices are stored per layer (``[tokens, top_k]``), the output is untouched;
- **replay**: the indices become the given ones, and the weights the router's own probabilities
  gathered at them, ``w_k = p[i_k]`` (divided by their sum when ``norm_topk_prob``), so the
  router weight keeps its gradient through ``p`` exactly as in a free forward; rows marked `FREE`
  (-1) keep the router's own choice. The logits (index 0, which the auxiliary losses read) are
  untouched.

Router disagreement (`unirl.core.maths.losses.router_disagreement`) is counted at each replayed
layer against the free top-k of that same forward.

Usage in a backend, per microbatch (``mb.routed_experts``: ``[T, moe_layers, top_k]`` in the
order of the tokens the model is given, for HF's packed ``[1, T]`` stream the microbatch's own)::

    replay = RouterReplay(model)                  # once, after the model is built
    with replay.replaying(mb.routed_experts):     # around forward AND backward: a checkpointed
        logits = model(...); loss.backward()      # layer recomputes its forward in backward
    metrics[ROUTER_DISAGREEMENT] = replay.disagreement_metric()

    with replay.recording():                      # R2: the old-log-prob forward
        logits = model(...)
    experts_t = replay.recorded()                 # [T, moe_layers, top_k] int32

Wiring in a Hugging Face backend (what the backend passes, per microbatch): build one
`RouterReplay` on a mixture-of-experts policy model (not on the reference or the critic: they
route freely), idle in a pass whose spec's ``routing`` (decided by core) is ``off``; in a
training pass whose ``routing`` is ``replay``, when ``mb.routed_experts`` is not None, enter ``replaying(mb.routed_experts)`` (moved to the device) before the forward and leave
it after the backward, and put `disagreement_metric` in the microbatch's metrics under
`unirl.core.maths.losses.router_disagreement.ROUTER_DISAGREEMENT` (also for an empty microbatch);
in the policy's forward-only pass replay the same way under ``replay`` and, under ``record``,
run inside `recording` and hand back `recorded` per microbatch (core maps the rows to samples with
`unirl.core.data.routed_experts.recorded_per_sample`). Rows are in the order of the model's input
rows: the packed ``[1, T]`` stream, under Ulysses the rank's CP-local tokens, which is exactly
``mb.routed_experts`` (CP padding rows are `FREE`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import nn
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from unirl.core.data.routed_experts import DTYPE, FREE
from unirl.core.errors import ConfigError, LossInputError
from unirl.core.maths.losses.metrics import Metric
from unirl.core.maths.losses.router_disagreement import (
    router_disagreement_metric,
    routing_disagreement,
)

# Routers whose forward returns (logits, top-k weights, top-k indices) from softmax top-k.
ROUTER_TYPES: tuple[type[nn.Module], ...] = (Qwen3MoeTopKRouter,)


def replayed_routing(
    logits_ne: torch.Tensor, indices_nk: torch.Tensor, norm_topk_prob: bool
) -> torch.Tensor:
    """The top-k weights of given experts: the router's softmax probabilities at ``indices_nk``,
    renormalised when ``norm_topk_prob`` (Hugging Face's arithmetic: fp32, then the logits'
    dtype). Differentiable in ``logits_ne``."""
    probs = torch.softmax(logits_ne, dim=-1, dtype=torch.float)
    weights = probs.gather(1, indices_nk)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits_ne.dtype)


class RouterReplay:
    """Forward hooks on every MoE router of ``model``, in module order (the i-th router is MoE
    layer i of ``routed_experts``); idle (no effect) outside `recording` / `replaying`."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, ROUTER_TYPES)]
        if not self.routers:
            raise ConfigError(
                f"routing replay: {type(model).__name__} has no MoE router this hook knows "
                f"({', '.join(t.__name__ for t in ROUTER_TYPES)}); use a Qwen3-MoE model or "
                "set algorithm.routing_replay: off"
            )
        self.top_k = int(self.routers[0].top_k)
        self._mode: Literal["idle", "record", "replay"] = "idle"
        self._experts: torch.Tensor | None = None  # [N, L, K] on the model's device
        # Per layer, overwritten by each call (a recomputed forward writes the same values).
        self._recorded: dict[int, torch.Tensor] = {}
        self._counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(self.routers)
        ]

    @property
    def num_moe_layers(self) -> int:
        return len(self.routers)

    def remove(self) -> None:
        """Detach the hooks (the model routes freely again, for good)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- modes -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the routers' own top-k for the forwards inside; read them with `recorded`."""
        self._enter("record")
        self._recorded = {}
        try:
            yield
        finally:
            self._mode = "idle"

    @contextlib.contextmanager
    def replaying(self, experts_nlk: torch.Tensor) -> Iterator[None]:
        """Replay ``experts_nlk`` (``[tokens, moe_layers, top_k]``, `FREE` rows routed freely)
        in the forwards and recomputed forwards inside; counts disagreement."""
        if experts_nlk.dim() != 3 or tuple(experts_nlk.shape[1:]) != (
            self.num_moe_layers,
            self.top_k,
        ):
            raise LossInputError(
                f"routing replay: routed_experts of shape {tuple(experts_nlk.shape)} for a model "
                f"with {self.num_moe_layers} MoE layers and top_k={self.top_k}; give "
                f"[tokens, {self.num_moe_layers}, {self.top_k}]"
            )
        self._enter("replay")
        self._experts = experts_nlk
        self._counts = {}
        try:
            yield
        finally:
            self._mode = "idle"
            self._experts = None

    def clear_disagreement(self) -> None:
        """Forget the last replayed forward's counts (a microbatch that replays nothing then
        reports 0 of 0)."""
        self._counts = {}

    def _enter(self, mode: Literal["record", "replay"]) -> None:
        if self._mode != "idle":
            raise RuntimeError(f"RouterReplay: {mode} inside {self._mode}")
        self._mode = mode

    # -- results ---------------------------------------------------------------------------

    def recorded(self) -> torch.Tensor:
        """``[tokens, moe_layers, top_k]`` int32: the experts of the last recorded forward."""
        missing = [i for i in range(self.num_moe_layers) if i not in self._recorded]
        if missing:
            raise RuntimeError(f"RouterReplay.recorded: MoE layers {missing} did not run")
        return torch.stack([self._recorded[i] for i in range(self.num_moe_layers)], dim=1)

    def disagreement_metric(self) -> Metric:
        """``router/disagreement`` of the last replayed forward, summed over its layers; 0 of 0
        decisions when none ran (an empty microbatch still reports it: every rank must reduce
        the same metric names)."""
        if not self._counts:
            zero = torch.zeros((), dtype=torch.int64, device=self.routers[0].weight.device)
            return router_disagreement_metric(zero, zero)
        differing = torch.stack([c[0] for c in self._counts.values()]).sum()
        decisions = torch.stack([c[1] for c in self._counts.values()]).sum()
        return router_disagreement_metric(differing, decisions)

    # -- the hook --------------------------------------------------------------------------

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._mode == "idle":
                return None
            logits, weights, indices = output
            if self._mode == "record":
                self._recorded[layer] = indices.detach().to(DTYPE)
                return None
            assert self._experts is not None
            given = self._experts[:, layer, :].to(device=indices.device, dtype=indices.dtype)
            if given.shape[0] != indices.shape[0]:
                raise LossInputError(
                    f"routing replay: MoE layer {layer} routes {indices.shape[0]} tokens but "
                    f"routed_experts has {given.shape[0]} rows; give one row per token of the "
                    "model's input, in its order"
                )
            self._counts[layer] = routing_disagreement(indices.detach(), given)
            free = given[:, :1] == FREE
            chosen = torch.where(free, indices, given)
            replayed = replayed_routing(logits, chosen, bool(module.norm_topk_prob))
            # free rows keep the router's own weights (the same values, from its own arithmetic)
            replayed = torch.where(free, weights, replayed)
            return logits, replayed, chosen

        return hook
