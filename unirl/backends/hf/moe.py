"""The policy's mixture-of-experts routing on a Hugging Face engine, per microbatch: the router
logits the loss reads (core adds the auxiliary losses, `unirl.core.moe_loss`) and routing replay
(`RouterReplay`, as each pass's spec says: its ``routing``, decided by core), wired as
`unirl.backends.hf.router_replay`'s docstring says.

The router logits come from a forward hook on each router (what transformers' own
``output_router_logits`` records, `OutputRecorder(Qwen3MoeTopKRouter, index=0)`), so the model
runs its normal forward and Hugging Face's own auxiliary loss is never computed or added. The
hook collects only while a training forward runs (`training`, until `take_router_logits`): a layer
recomputed in backward (activation checkpointing) does not add its logits twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from unirl.backends.hf.router_replay import ROUTER_TYPES, RouterReplay
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.logprob_spec import RoutingReplay
from unirl.core.maths.losses import Metric
from unirl.core.maths.losses.router_disagreement import ROUTER_DISAGREEMENT


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of ``model`` in module order (none: a dense model)."""
    return [m for m in model.modules() if isinstance(m, ROUTER_TYPES)]


class PolicyRouting:
    """Router-logit capture and routing replay on the policy model. Each pass says how its
    routers run (its spec's ``routing``, decided by core): `begin` sets it. The replay hooks
    are idle (no effect) in a pass whose routing is ``off``."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.mode: RoutingReplay = "off"  # of the pass running now
        self.replay = RouterReplay(model)
        self._logits: dict[int, torch.Tensor] | None = None  # collecting when not None
        self._recorded: list[torch.Tensor] = []
        self._handles = [
            router.register_forward_hook(self._capture(layer))
            for layer, router in enumerate(self.routers)
        ]

    def _capture(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._logits is not None:
                self._logits[layer] = output[0]

        return hook

    # -- the training pass -----------------------------------------------------------------

    @contextlib.contextmanager
    def training(self, mb: TrainMicrobatch) -> Iterator[None]:
        """Around one microbatch's forward AND backward: replay ``mb.routed_experts`` (when
        given: core hands them only to a pass that replays) and collect the router logits of
        the forward."""
        self._logits = {}
        try:
            with self._replaying(mb):
                yield
        finally:
            self._logits = None

    def take_router_logits(self) -> list[torch.Tensor] | None:
        """Each MoE layer's router logits of the forward just run (then stop collecting); None
        for a dense model."""
        logits, self._logits = self._logits, None
        if not self.routers:
            return None
        assert logits is not None and len(logits) == len(self.routers), "router did not run"
        return [logits[i] for i in range(len(self.routers))]

    def training_metrics(self, mb: TrainMicrobatch) -> Mapping[str, Metric]:
        """``router/disagreement`` of the microbatch just trained on, when the pass replays
        (every microbatch reports it, also an empty one or one without experts: 0 of 0)."""
        if self.mode == "off":
            return {}
        return {ROUTER_DISAGREEMENT: self.replay.disagreement_metric()}

    # -- the forward-only pass -------------------------------------------------------------

    def begin(self, mode: RoutingReplay) -> None:
        """Before a policy pass: how its routers run (its spec's ``routing``)."""
        self.mode = mode

    def begin_forward_only(self, mode: RoutingReplay) -> None:
        """Before a policy forward-only pass: its routing; forget the last pass's records."""
        self.begin(mode)
        self._recorded = []

    @contextlib.contextmanager
    def forward_only(self, mb: TrainMicrobatch) -> Iterator[None]:
        """Around one forward-only microbatch of the policy: ``record`` records (R2), ``replay``
        replays the microbatch's experts (R3), ``off`` routes freely."""
        if self.mode == "record":
            with self.replay.recording():
                yield
            self._recorded.append(self.replay.recorded())
            return
        if self.mode == "off":
            yield
            return
        with self._replaying(mb):
            yield

    def recorded(self) -> list[torch.Tensor]:
        """Per microbatch of the last policy forward-only pass, ``[T_local, moe_layers, top_k]``
        int32 on the CPU (an empty microbatch: its one pad-token row)."""
        if self.mode != "record":
            raise RuntimeError("recorded routing: the last policy pass did not record")
        return [e.cpu() for e in self._recorded]

    def _replaying(self, mb: TrainMicrobatch) -> contextlib.AbstractContextManager[None]:
        if mb.routed_experts is None or mb.num_tokens == 0:
            self.replay.clear_disagreement()  # 0 of 0 decisions for this microbatch
            return contextlib.nullcontext()
        return self.replay.replaying(mb.routed_experts)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.replay.remove()
