"""`HFBackend`: unirl's `TrainingBackend` for an engine that trains Hugging Face models, written
once for DeepSpeed, FSDP2 and the next such engine.

The backend holds models, not copies of itself: the policy and (with a critic) the critic are
trained models of the engine's one class, the reference is a frozen `PackedModule`; every pass
is `unirl.backends.hf.loop`'s, with the log-prob head (`LogprobHead`) for the policy and the
reference and the value head for the critic (`HFCritic`). One optimizer step, as core drives it::

    backend = build_backend(cfg, total_optimizer_steps=n, needs_reference=kl_on)
    old = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)   # if recompute
    metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
    stats = backend.optimizer_step()            # grad norm before clipping, lr used

An engine subclasses `HFBackend` and says how to start its processes, switch a model to its
attention, wrap a model for training (`_trained`) or for frozen forwards (`_frozen`), and how it
writes its checkpoint files (``checkpoints``); the loss arithmetic is its trained model's
``loss_scale`` alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from unirl.backends.base import EngineBackend, ForwardOnlyPass, TrainingPass
from unirl.backends.causal_lm import load_critic, load_policy, load_reference, torch_dtype
from unirl.backends.hf import checkpoint
from unirl.backends.hf.checkpoint import CheckpointFiles
from unirl.backends.hf.critic import HFCritic
from unirl.backends.hf.export import write_hf_folder
from unirl.backends.hf.fused_head import FusedLMHead, install_fused_head
from unirl.backends.hf.liger import apply_liger_kernels
from unirl.backends.hf.loop import HeadOutput, LogprobHead, forward_only_pass, training_pass
from unirl.backends.hf.lora import (
    adapter_state,
    base_fingerprint,
    base_state,
    expert_wrappers,
    merged_state,
    target_parameters,
    wrap_policy,
)
from unirl.backends.hf.model import PackedModule, TrainedModel, Training
from unirl.backends.hf.moe import PolicyRouting, moe_routers
from unirl.backends.peft_folder import write_peft_folder
from unirl.backends.process_group import ProcessGroupSetup
from unirl.core.backend import ModelRole, OptimizerStepStats
from unirl.core.config.derived import fused_head
from unirl.core.config.run_config import UnirlConfig, critic_enabled
from unirl.core.critic import critic_optimizer_steps
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.errors import ConfigError
from unirl.core.maths.losses import Metric
from unirl.core.topology import Topology
from unirl.core.weights.stream import HOST, WeightBuckets, checked_stream, state_buckets


class HFBackend(EngineBackend):
    """See the module docstring."""

    checkpoints: ClassVar[CheckpointFiles]

    def __init__(
        self, cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self._dist, self.topology = self._start()
        model = load_policy(cfg.model)
        # model.fused_head: the LM head computes the log-probs (no [T, V] logits)
        self._heads: dict[ModelRole, FusedLMHead | None] = {"policy": self._prepare(model)}
        self.vocab_size = int(model.config.vocab_size)
        # A mixture-of-experts policy: its router logits for core's auxiliary losses, and routing
        # replay (`unirl.backends.hf.moe`); the reference and the critic route freely.
        self._routing = PolicyRouting(model) if moe_routers(model) else None
        # model.lora: peft wraps the policy before the engine does (`unirl.backends.hf.lora`);
        # the reference is then the policy with its adapter off unless model.ref_path is set.
        self.lora = cfg.model.lora
        self.base_fingerprint: str | None = None
        if self.lora is not None:
            self.base_fingerprint = base_fingerprint(model)
            try:
                model = wrap_policy(model, cfg.model)
            except ConfigError:
                self._stop()  # a bad target: leave the process group as it was found
                raise
            if cfg.model.ref_path is None:
                self._heads["reference"] = self._heads["policy"]
        self.policy = self._trained(
            model, Training("policy", cfg.optimizer, "optimizer", total_optimizer_steps)
        )
        self.device = self.policy.device
        self._reference: PackedModule | None = None
        self._closed = False
        if needs_reference:
            self._reference_model()
        self.critic: HFCritic | None = None
        if critic_enabled(cfg):
            critic = load_critic(cfg.model, cfg.critic)
            self._kernels(critic)
            self._use_attention(critic)
            steps = critic_optimizer_steps(cfg, total_optimizer_steps)
            training = Training("critic", cfg.critic.optimizer, "critic.optimizer", steps)
            self.critic = HFCritic(self._trained(critic, training))

    # -- what an engine supplies -------------------------------------------------------------

    def _start(self) -> tuple[ProcessGroupSetup, Topology]:
        """Join or create the process group; this rank's topology."""
        raise NotImplementedError

    def _use_attention(self, model: Any) -> None:
        """Switch a freshly loaded HF model to the engine's packed attention."""
        raise NotImplementedError

    def _trained(self, model: Any, training: Training) -> TrainedModel:
        """``model`` wrapped for training as ``training`` says."""
        raise NotImplementedError

    def _frozen(self, model: Any) -> PackedModule:
        """The reference wrapped for forward-only passes."""
        raise NotImplementedError

    def _stop(self) -> None:
        """Leave the process group (destroy it only if `_start` created it)."""
        raise NotImplementedError

    # -- the TrainingBackend -----------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The Hugging Face module being trained (the one whose forward the contract hooks)."""
        return self.policy.hf_module

    def loss_scale(self, num_microbatches: int) -> float:
        return self.policy.loss_scale(num_microbatches)

    def _prepare(self, model: Any) -> FusedLMHead | None:
        self._kernels(model)
        self._use_attention(model)
        return install_fused_head(model) if fused_head(self.cfg) else None

    def _kernels(self, model: Any) -> None:
        """``model.liger_kernels``: Liger's RMSNorm / rotary / SwiGLU kernels (`hf.liger`)."""
        if self.cfg.model.liger_kernels:
            apply_liger_kernels(model, self._dist.device.type)

    @property
    def _reference_is_base(self) -> bool:
        """The reference is the policy with its adapter off (``model.lora``, no ref_path)."""
        return self.lora is not None and self.cfg.model.ref_path is None

    def _reference_model(self) -> PackedModule:
        if self._reference_is_base:
            return self.policy
        if self._reference is None:
            ref = load_reference(self.cfg.model)
            self._heads["reference"] = self._prepare(ref)
            self._reference = self._frozen(ref)
        return self._reference

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        role = run.role
        model = self.policy if role == "policy" else self._reference_model()
        routing = self._routing if role == "policy" else None
        around = None if routing is None else routing.forward_only
        if routing is not None:
            routing.begin_forward_only(run.spec.routing)
        if role == "reference" and self._reference_is_base:
            around = self._adapter_off
        return forward_only_pass(
            model,
            LogprobHead(self._heads[role], run.spec),
            run.microbatches,
            progress=run.progress,
            count=lambda: self._count_forward(role),
            around=around,
        )

    def _adapter_off(self, mb: TrainMicrobatch) -> AbstractContextManager[Any]:
        return self.policy.hf_module.disable_adapter()

    def recorded_routing(self) -> list[torch.Tensor]:
        """`unirl.core.backend.RecordsRouting`: the experts the last policy forward-only pass
        recorded, per microbatch (``routing_replay: record``)."""
        if self._routing is None:
            raise RuntimeError("recorded_routing: the policy is not a mixture-of-experts model")
        return self._routing.recorded()

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        routing = self._routing
        if routing is not None:
            routing.begin(run.spec.routing)

        def loss(mb: TrainMicrobatch, out: HeadOutput):
            if routing is None:
                return run.loss_fn(mb, out.values, out.entropy)
            logits = routing.take_router_logits()
            return run.loss_fn(mb, out.values, out.entropy, router_logits=logits)

        # An MoE policy's loss also takes its router logits (core's auxiliary losses), which only
        # the loop has after the forward: its loss is computed after the head, not inside it.
        head = (
            LogprobHead.for_training(self._heads["policy"], run.spec, run.loss_fn)
            if routing is None
            else LogprobHead(self._heads["policy"], run.spec)
        )
        return training_pass(
            self.policy,
            head,
            run.microbatches,
            loss=loss,
            progress=run.progress,
            count=lambda: self._count_forward("policy"),
            around=None if routing is None else routing.training,
            around_metrics=None if routing is None else routing.training_metrics,
        )

    def optimizer_step(self) -> OptimizerStepStats:
        return self.policy.optimizer_step()

    def _extra_models(self) -> dict[str, TrainedModel]:
        return {} if self.critic is None else {"critic": self.critic.model}

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None:
        checkpoint.save_checkpoint(
            self.checkpoints,
            self.policy,
            Path(path),
            client_state,
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            extra=self._extra_models(),
            lora_base=self.base_fingerprint,
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return checkpoint.load_checkpoint(
            self.checkpoints,
            self.policy,
            Path(path),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            extra=self._extra_models(),
            lora_base=self.base_fingerprint,
        )

    def export_hf(self, path: Path) -> None:
        """The policy as a full Hugging Face folder; under ``model.lora`` the merged weights
        (the run's own final export is then the adapter, `export_adapter`)."""
        if self.lora is None:
            self.policy.export_hf(Path(path))
            return
        merged = self.hf_state_dict()
        base = self.policy.hf_module.get_base_model()
        dtype = torch_dtype(self.cfg.model)
        write_hf_folder(base, merged, self.cfg.model, Path(path), rank=self._dist.rank, dtype=dtype)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Under ``model.lora`` the merged weights ``W + scale * B @ A`` in clean names."""
        state = self.policy.hf_state_dict()
        if self.lora is None:
            return state
        return merged_state(state, self.lora.scale, expert_wrappers(self.policy.hf_module))

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        if self.lora is None:
            return self.policy.stream_weights(bucket_bytes, dst=dst, device=device)
        return checked_stream(
            self.non_finite_weight,
            lambda: state_buckets(self.hf_state_dict(), bucket_bytes, dst=dst, device=device),
        )

    def stream_base_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """`unirl.core.backend.TrainsAdapter`: the base weights (the adapter left out), as
        `stream_weights` streams the merged ones."""
        self._need_adapter("stream_base_weights")
        return checked_stream(
            self.non_finite_weight,
            lambda: state_buckets(
                base_state(self.policy.hf_state_dict()), bucket_bytes, dst=dst, device=device
            ),
        )

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """`unirl.core.backend.TrainsAdapter`: the adapter in PEFT's names, on every rank, in
        the trained parameters' dtype (collective)."""
        self._need_adapter("adapter_state_dict")
        return adapter_state(self.policy.trainable_state_dict())

    def export_adapter(self, path: Path) -> None:
        """`unirl.core.backend.TrainsAdapter`: rank 0 writes the PEFT folder (collective)."""
        state = self.adapter_state_dict()
        assert self.lora is not None
        if self._dist.rank == 0:
            write_peft_folder(
                state,
                self.lora,
                Path(path),
                base_model=self.cfg.model.path,
                target_parameters=target_parameters(self.policy.hf_module),
            )
        dist.barrier()

    def _need_adapter(self, call: str) -> None:
        if self.lora is None:
            raise RuntimeError(f"{call}: the policy has no adapter (model.lora is unset)")

    def non_finite_weight(self) -> str | None:
        return self.policy.non_finite_weight()

    def close(self) -> None:
        """Free the models; leave the process group."""
        if self._closed:
            return
        self._closed = True
        if self._routing is not None:
            self._routing.remove()
            self._routing = None
        self.policy.close()
        if self.critic is not None:
            self.critic.close()
        if self._reference is not None:
            self._reference.close()
        self._reference = None
        self._stop()
