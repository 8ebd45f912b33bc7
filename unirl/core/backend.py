"""The interface every training engine implements, and the one piece of maths they share.

The seam: a backend turns a `TrainMicrobatch` into logits, calls `token_logprobs` (core) to get
per-token log-probs (or, with ``model.fused_head``, hands the final hidden states and the LM
head's weight to `token_logprobs_from_hidden`, which never makes the ``[T, V]`` logits), hands them to the core loss function it is given, and multiplies the returned
loss by exactly one factor that cancels its own averaging (`TrainingBackend.loss_scale`). It never
computes a log-softmax, a ratio or a normaliser itself.

`TrainingBackend` states everything the RL step and the tools use; how a backend is constructed
and registered is `unirl.core.protocols.backend_plugin`. `InstrumentedBackend` adds the probes the contract
suite reads (which model modules to hook, forward counts) and is not part of what a run needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import torch

from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.head_loss import HeadLossOutput, head_loss
from unirl.core.maths.logprob_spec import LogprobSpec
from unirl.core.maths.logprobs import logprobs_from_logits
from unirl.core.maths.logprobs_hidden import logprobs_from_hidden
from unirl.core.maths.losses import Metric
from unirl.core.moe_loss import RouterLossSettings
from unirl.core.progress.bars import MicrobatchProgress
from unirl.core.topology import Topology
from unirl.core.weights.stream import HOST, WeightBuckets

__all__ = [
    "AdamStepSettings",
    "CriticModel",
    "InstrumentedBackend",
    "LogprobSpec",
    "LossFn",
    "ModelRole",
    "OptimizerStepStats",
    "RecordsRouting",
    "TakesStepSettings",
    "TrainingBackend",
    "ValueLossFn",
    "token_logprobs",
    "token_logprobs_from_hidden",
]


class LossFn(Protocol):
    """``loss_fn(microbatch, logprobs [T] fp32 with grad, entropy [T] or None) -> (loss,
    metrics)``; the loss is this microbatch's share of the step objective (core normalises
    globally). A mixture-of-experts backend also passes ``router_logits``: each MoE layer's
    router logits ``[rows, num_experts]`` of this forward (with their gradient), from which core
    adds the router's auxiliary losses (`unirl.core.moe_loss`). ``router``: the settings of that
    term (the step's coefficients; None: no term), for a backend that cannot hand some layers'
    logits to the loss and adds their share itself (core's `LossWithRouterTerm` is one)."""

    @property
    def router(self) -> RouterLossSettings | None: ...

    def __call__(
        self,
        mb: TrainMicrobatch,
        logprobs: torch.Tensor,
        entropy: torch.Tensor | None,
        /,
        *,
        router_logits: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Mapping[str, Metric]]: ...


@runtime_checkable
class RecordsRouting(Protocol):
    """A backend whose policy forward-only pass records MoE routing (``spec.routing: record``,
    R2): after `TrainingBackend.forward_logprobs` with ``role="policy"`` it hands back, per
    microbatch of that call, the experts its routers chose ``[T_local, moe_layers, top_k]`` int32
    (CP-local rows, as the log-probs)."""

    def recorded_routing(self) -> list[torch.Tensor]: ...


ModelRole = Literal["policy", "reference"]
# value_loss_fn(microbatch, values [T] fp32 with grad) -> (loss, metrics): the critic's share.
ValueLossFn = Callable[[TrainMicrobatch, torch.Tensor], tuple[torch.Tensor, Mapping[str, Metric]]]


def token_logprobs(
    logits_tv: torch.Tensor,
    targets_t: torch.Tensor,
    spec: LogprobSpec,
    *,
    tp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of `targets_t` from local logits ``[T, V_local]``."""
    if spec.with_entropy:
        logp, ent = logprobs_from_logits(
            logits_tv,
            targets_t,
            tp_group=tp_group,
            temperature=spec.temperature,
            vocab_size=spec.vocab_size,
            with_entropy=True,
            entropy_grad=spec.entropy_grad,
            check_targets=not spec.targets_checked,
        )
        return logp, ent
    logp = logprobs_from_logits(
        logits_tv,
        targets_t,
        tp_group=tp_group,
        temperature=spec.temperature,
        vocab_size=spec.vocab_size,
        check_targets=not spec.targets_checked,
    )
    return logp, None


def token_logprobs_from_hidden(
    hidden_th: torch.Tensor,
    weight_vh: torch.Tensor,
    targets_t: torch.Tensor,
    spec: LogprobSpec,
    *,
    tp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of the logits ``hidden_th @ weight_vh.T`` (``weight_vh``: this rank's
    vocabulary shard of the LM head), computed without them (`logprobs_from_hidden`)."""
    if spec.with_entropy:
        logp, ent = logprobs_from_hidden(
            hidden_th,
            weight_vh,
            targets_t,
            tp_group=tp_group,
            temperature=spec.temperature,
            vocab_size=spec.vocab_size,
            with_entropy=True,
            entropy_grad=spec.entropy_grad,
        )
        return logp, ent
    logp = logprobs_from_hidden(
        hidden_th,
        weight_vh,
        targets_t,
        tp_group=tp_group,
        temperature=spec.temperature,
        vocab_size=spec.vocab_size,
    )
    return logp, None


def token_loss_from_hidden(
    hidden_th: torch.Tensor,
    weight_vh: torch.Tensor,
    mb: TrainMicrobatch,
    spec: LogprobSpec,
    loss_fn: LossFn,
    *,
    tp_group: Any = None,
) -> HeadLossOutput:
    """``loss_fn(mb, ...)`` of the log-probs of ``hidden_th @ weight_vh.T`` with the loss inside
    the fused head (`head_loss`: three head matmuls, the gradients of both made in the forward).
    Only for a separable loss (`unirl.core.maths.head_loss.choose_head_path`); the backend then
    multiplies ``.loss`` by its `TrainingBackend.loss_scale` and runs backward as with
    `token_logprobs_from_hidden` + ``loss_fn``; ``.metrics`` are ``loss_fn``'s, ``.logprobs``
    the detached log-probs."""
    return head_loss(
        hidden_th,
        weight_vh,
        mb.targets,
        lambda logp, entropy: loss_fn(mb, logp, entropy),
        tp_group=tp_group,
        temperature=spec.temperature,
        vocab_size=spec.vocab_size,
        with_entropy=spec.with_entropy,
        entropy_grad=spec.entropy_grad,
    )


@attrs.frozen(kw_only=True)
class OptimizerStepStats:
    grad_norm: float
    lr: float
    skipped: bool = False  # e.g. a non-finite gradient norm: weights untouched


@runtime_checkable
class CriticModel(Protocol):
    """PPO's value model as core's RL step drives it: a causal-LM backbone with a scalar head per
    token, on the same processes and parallel layout as its policy, with its own optimizer and
    LR schedule. The seam is the policy's: the backend makes the per-token values ``[T]`` (fp32,
    logit-position alignment: position t is V of the prefix that predicts ``targets[t]``, the
    value before that response token; CP-local); core computes GAE and the value loss, and the
    backend multiplies the loss by its one averaging factor. Checkpoints and ``--resume`` include
    it through its backend's `TrainingBackend.save_checkpoint` / ``load_checkpoint``."""

    def forward_values(
        self, microbatches: Sequence[TrainMicrobatch], *, progress: MicrobatchProgress
    ) -> list[torch.Tensor]:
        """Forward-only: detached fp32 values ``[T]`` per microbatch ([] off the last pipeline
        stage)."""
        ...

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: ValueLossFn,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        """Accumulate the critic's gradients over one optimizer step's microbatches."""
        ...

    def optimizer_step(self) -> OptimizerStepStats: ...

    def export_hf(self, path: Path) -> None:
        """The critic in Hugging Face layout (``AutoModelForTokenClassification``, one label):
        collective, one rank writes."""
        ...


@runtime_checkable
class TrainingBackend(Protocol):
    """What core's RL step needs from an engine. Implementations live in unirl/backends/<name>
    and are built by their plug-in's ``build(cfg, total_optimizer_steps=..., needs_reference=...)``
    (`unirl.core.protocols.backend_plugin.BackendBuilder`)."""

    topology: Topology
    vocab_size: int
    # Where this rank computes: the core step's data-parallel reductions run on it.
    device: torch.device
    # PPO's value model, built when the config enables one (`critic_enabled`); else None.
    critic: CriticModel | None

    def loss_scale(self, num_microbatches: int) -> float:
        """The one factor each microbatch's loss is multiplied by before its backward: it cancels
        the engine's own averaging (over microbatches, over data-parallel ranks), so that the
        gradient is that of the SUM of the core losses. ``num_microbatches``: of this optimizer
        step on this rank, as the engine runs them."""
        ...

    def forward_logprobs(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        role: ModelRole,
        spec: LogprobSpec,
        progress: MicrobatchProgress,
    ) -> list[torch.Tensor]:
        """Forward-only pass; per microbatch the detached fp32 log-probs ``[T]`` (logit-position
        alignment, CP-local). Ranks that hold no loss (non-last pipeline stages) return [].
        An MoE policy's routers run as ``spec.routing`` says (decided by core): ``record``
        (then `RecordsRouting`), ``replay`` each microbatch's ``routed_experts``, or ``off``."""
        ...

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: LossFn,
        spec: LogprobSpec,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        """Accumulate gradients of every microbatch of one optimizer step; per-microbatch metrics
        (empty on ranks without the loss). Under ``spec.routing: replay`` a microbatch that
        carries ``routed_experts`` has them replayed (and ``router/disagreement`` reported)."""
        ...

    def optimizer_step(self) -> OptimizerStepStats: ...

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None: ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]: ...

    def export_hf(self, path: Path) -> None: ...

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights in Hugging Face names, on the CPU, on every rank (collective).
        For tools and tests; a training step syncs with `stream_weights`."""
        ...

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """The policy weights as `hf_state_dict` holds them (same names, dtypes, values), in
        buckets of at most ``bucket_bytes`` made by the ranks that own them, on global rank
        ``dst`` (None: every rank), the tensors on ``device`` (the host, or the receiving rank's
        GPU: gathered there, no host copy of any weight; the built-in backends make each bucket
        one `FlatBucket` there, which the GPU transports send as it is); see
        `unirl.core.weights.stream`. Collective: every rank calls it and runs the iterator to its
        end. Raises `NonFiniteWeightsError` on every rank, before any bucket, when a weight is
        not finite."""
        ...

    def non_finite_weight(self) -> str | None:
        """The first parameter holding a NaN or an infinity, or None; from each rank's own shards
        and one all-reduce of a flag (collective)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class TrainsAdapter(Protocol):
    """A backend training a LoRA adapter (``model.lora``): the adapter is what it checkpoints,
    exports and syncs to the rollout engine; the base weights never change."""

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The full adapter in PEFT's names (``base_model.model.<HF module path>.lora_A.weight``,
        A ``[rank, in]``, B ``[out, rank]``, as `peft.get_peft_model_state_dict` gives them), on
        the CPU, on every rank (collective). Megatron's fused layers are split into their HF
        targets (q/k/v, gate/up) and its shards gathered."""
        ...

    def stream_base_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """The base weights, the adapter left out, in Hugging Face names, streamed as
        `TrainingBackend.stream_weights` streams the (merged) policy: what a rollout engine that
        keeps the base weights loads once (`unirl.core.weight_sync`), also on a resumed run,
        whose merged weights are no longer the base."""
        ...

    def export_adapter(self, path: Path) -> None:
        """Collective: rank 0 writes the adapter as a PEFT folder
        (`unirl.backends.peft_folder.write_peft_folder`)."""
        ...


@attrs.frozen(kw_only=True)
class AdamStepSettings:
    """The next optimizer step's AdamW settings, given by the caller step by step (the Tinker
    API's ``optim_step`` sends them with every step). ``grad_clip`` 0: no clipping;
    ``weight_decay`` is decoupled and applies where the backend's config decays (matrices)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float


@runtime_checkable
class TakesStepSettings(Protocol):
    """A backend whose optimizer takes its settings per step (`AdamStepSettings`) instead of
    from its config's LR schedule."""

    def set_step_settings(self, settings: AdamStepSettings) -> None:
        """Used by the next `TrainingBackend.optimizer_step` (and the ones after it until set
        again); the config's schedule no longer decides the learning rate."""
        ...


@runtime_checkable
class InstrumentedBackend(TrainingBackend, Protocol):
    """A backend the contract suite can observe: not needed to train, needed to prove that a
    forward-only pass was skipped or ran once per microbatch."""

    # The model module(s) whose forward the suite hooks (a module, or the chunks of a pipeline
    # rank in virtual-stage order; the suite counts chunk 0).
    model: torch.nn.Module | Sequence[torch.nn.Module]
    # Model forwards run per role, training and forward-only alike, once per microbatch.
    forward_calls: Mapping[ModelRole, int]
