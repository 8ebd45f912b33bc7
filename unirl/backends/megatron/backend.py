"""`MegatronBackend`: unirl's `TrainingBackend` on megatron-core (TP, PP, VPP; DP with DDP and the
distributed optimizer) with a Hugging Face Llama / Qwen2 model.

One optimizer step, as core's RL step drives it::

    backend = MegatronBackend(cfg, total_optimizer_steps=n, needs_reference=kl_on)
    old = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)   # if recompute
    metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
    stats = backend.optimizer_step()            # grad norm before clipping, lr used

The backend holds its models, each a `role_model.MegatronModel` (the trained policy, the frozen
reference, the critic of `critic`), and runs every pass of every model through one loop
(`passes.MicrobatchLoop`): one call of megatron's schedule for the layout (`schedule`), each
microbatch one packed token stream (`packed`: THD with varlen flash attention, context parallel
included) or, with ``megatron.attention: padded | unfused``, right-padded rows (`padded`). On the
last pipeline stage the model's head (`heads`) hands the vocabulary-parallel logits of the real
tokens to core's `token_logprobs` (TP all-reduces of per-token statistics only, never the full
vocabulary; with ``model.fused_head`` the hidden states and the output layer's weight shard to
`token_logprobs_from_hidden`, `fused_head`), and those go to core's loss. The only loss
arithmetic here is `schedule.loss_scale`, the factor that cancels megatron's mean over
microbatches and data-parallel ranks.

On the CPU (gloo) the same megatron-core schedules, DDP and optimizer run, with the few
CUDA-only lines of megatron-core patched by `cpu_compat` (installed only when the device is the
CPU; on a GPU nothing is patched). Wherever Transformer Engine is absent, CPU or GPU, an MoE
model's build runs `te_compat` (names megatron-core reads but only its TE import binds: the
router's gating).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from unirl.backends.base import EngineBackend, ForwardOnlyPass, TrainingPass
from unirl.backends.megatron import checkpoint
from unirl.backends.megatron.compat import cpu as cpu_compat
from unirl.backends.megatron.compat import sequence_parallel
from unirl.backends.megatron.critic import MegatronCritic, critic_plan
from unirl.backends.megatron.heads import LogprobHead
from unirl.backends.megatron.lora.install import check_targets, install_lora
from unirl.backends.megatron.lora.state import load_peft_folder
from unirl.backends.megatron.moe.layers import is_moe
from unirl.backends.megatron.moe.replay import ScheduleReplay
from unirl.backends.megatron.optimizer import use_distributed_optimizer
from unirl.backends.megatron.passes import MicrobatchLoop
from unirl.backends.megatron.role_model import MegatronModel, OptimizerPlan, build_chunks
from unirl.backends.megatron.sources import ModelSource, policy_source, reference_source
from unirl.backends.megatron.topology import (
    hold_parallel_state,
    release_parallel_state,
    topology_from_parallel_state,
)
from unirl.backends.peft_folder import write_peft_folder
from unirl.backends.process_group import destroy_process_group, init_process_group
from unirl.core.backend import AdamStepSettings, OptimizerStepStats
from unirl.core.config.derived import fused_head, optimizer_offload
from unirl.core.config.model_shape import moe_shape
from unirl.core.config.run_config import UnirlConfig, critic_enabled
from unirl.core.errors import ConfigError
from unirl.core.maths.logprob_spec import RoutingReplay
from unirl.core.maths.losses import Metric
from unirl.core.weights.stream import HOST, WeightBuckets

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _seed_model_parallel_rng(seed: int, device: torch.device) -> None:
    """megatron's tensor-parallel CUDA RNG tracker (used by its layers for dropout and
    recompute), seeded without moving the caller's default CUDA generator."""
    from megatron.core import tensor_parallel

    if device.type != "cuda" or tensor_parallel.get_cuda_rng_tracker().is_initialized():
        return
    with torch.random.fork_rng(devices=[device]):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronBackend(EngineBackend):
    """See the module docstring. Holds the models (``policy``; the ``reference``, built when
    first asked for; the ``critic``'s) and the one `MicrobatchLoop` that runs them."""

    def __init__(
        self, cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> None:
        super().__init__()
        # the schedules are checked before anything is built
        plan = OptimizerPlan(
            name="policy",
            key="optimizer",
            section=cfg.optimizer,
            total_steps=total_optimizer_steps,
            distributed=use_distributed_optimizer(cfg),
            offload_state=optimizer_offload(cfg),
        )
        value_plan = critic_plan(cfg, total_optimizer_steps) if critic_enabled(cfg) else None
        self.cfg = cfg
        if cfg.model.lora is not None:
            check_targets(cfg.model.lora)
            if "lm_head" in cfg.model.lora.target_modules and fused_head(cfg):
                raise ConfigError(
                    "model.lora.target_modules: lm_head with model.fused_head: the fused head "
                    "reads the output layer's weight directly, past the adapter; set "
                    "model.fused_head: false or remove lm_head from the targets"
                )
        # LoRA without model.ref_path: the reference is the policy with its adapter off
        self._adapter_off_reference = cfg.model.lora is not None and cfg.model.ref_path is None
        self.dtype = _DTYPES[cfg.model.dtype]
        self._process_group = init_process_group(cfg.parallel)
        self.device = self._process_group.device
        if self.device.type == "cpu":
            cpu_compat.install()  # megatron-core's CUDA-only lines, on the CPU only
            if cfg.parallel.sequence_parallel:
                sequence_parallel.install_cpu_rng_tracker()
        hold_parallel_state(cfg.parallel)
        self.topology = topology_from_parallel_state()
        _seed_model_parallel_rng(cfg.train.seed, self.device)
        self.loop = MicrobatchLoop(
            self.topology,
            self.device,
            packed=cfg.backend_options.attention == "packed",
            seq_multiple=sequence_parallel.sequence_multiple(cfg.parallel),
        )
        self._head = LogprobHead(
            fused=fused_head(cfg),
            tp_group=self.topology.groups.tp if self.topology.tp_size > 1 else None,
        )
        source = policy_source(cfg)
        self.vocab_size = int(source.hf_config.vocab_size)
        self.policy = self._lm_model(
            source, plan, recompute=cfg.model.gradient_checkpointing, lora=True
        )
        # an MoE policy's routers record their logits with autograd for the router losses,
        # unless megatron's full recompute is on (its first forward runs them without autograd;
        # the plug-in's check refuses non-zero coefficients then)
        self._router_logits = is_moe(source.hf_config) and not cfg.model.gradient_checkpointing
        self._router_shape = moe_shape(cfg.model) if is_moe(source.hf_config) else None
        self._recorded: list[torch.Tensor] | None = None
        self._reference: MegatronModel | None = None
        self._closed = False
        if needs_reference and not self._adapter_off_reference:
            self.reference()
        self.critic: MegatronCritic | None = None
        if value_plan is not None:
            self.critic = MegatronCritic.build(cfg, value_plan, self.loop, dtype=self.dtype)

    # -- models ------------------------------------------------------------------------------

    def _lm_model(
        self,
        source: ModelSource,
        plan: OptimizerPlan | None,
        *,
        recompute: bool = False,
        lora: bool = False,
    ) -> MegatronModel:
        """A language model's chunks; ``lora``: with ``model.lora``'s adapters (the policy)."""
        chunks = build_chunks(
            source, self.cfg, self.topology, dtype=self.dtype, recompute=recompute
        )
        adapters = None
        if lora and self.cfg.model.lora is not None:
            adapters = install_lora(
                chunks, self.cfg.model.lora, vocab_size=self.vocab_size, recompute=recompute
            )
            if self.cfg.model.lora.path is not None:
                load_peft_folder(adapters, self.cfg.model.lora.path)
        return MegatronModel(
            chunks,
            hf_config=source.hf_config,
            head=self._head,
            cfg=self.cfg,
            topology=self.topology,
            plan=plan,
            offload=self.cfg.model.ref_offload,
            adapters=adapters,
        )

    def reference(self) -> MegatronModel:
        """The frozen reference model (built when first asked for). Under LoRA without
        ``model.ref_path`` there is none: the reference passes run the policy with its adapter
        off."""
        if self._adapter_off_reference:
            raise RuntimeError(
                "MegatronBackend.reference: under model.lora without model.ref_path the reference "
                "is the policy with its adapter off (forward_logprobs(role='reference')), not a "
                "model of its own"
            )
        if self._reference is None:
            source = reference_source(self.cfg)
            if source.hf_config.vocab_size != self.vocab_size:
                raise ConfigError(
                    f"model.ref_path has vocab_size={source.hf_config.vocab_size}, the policy "
                    f"{self.vocab_size}; the reference must share the policy's tokenizer"
                )
            self._reference = self._lm_model(source, None)
        return self._reference

    @property
    def model(self) -> list[torch.nn.Module]:
        """This rank's policy model chunks (megatron GPTModels, one per virtual stage)."""
        return self.policy.chunks

    @property
    def hf_config(self) -> Any:
        return self.policy.hf_config

    def loss_scale(self, num_microbatches: int) -> float:
        """The factor that cancels megatron's mean over microbatches and data-parallel ranks
        (`schedule.loss_scale`); ``num_microbatches`` counts the schedule's padding ones too."""
        return self.loop.loss_scale(num_microbatches)

    # -- passes ------------------------------------------------------------------------------

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        if run.role == "reference" and self._adapter_off_reference:
            assert self.policy.adapters is not None
            with self.policy.adapters.disabled():
                return self._run_forward(self.policy, run)
        model = self.policy if run.role == "policy" else self.reference()
        return self._run_forward(model, run)

    def _run_forward(self, model: MegatronModel, run: ForwardOnlyPass) -> list[torch.Tensor]:
        # the policy replays (R3) or records (R2), as the pass's spec says (decided by core);
        # the reference routes freely
        records = run.spec.routing == "record"
        replay = self._replay(run.spec.routing) if run.role == "policy" else None
        try:
            out = self.loop.forward_only(
                model,
                run.microbatches,
                spec=run.spec,
                on_forward=lambda: self._count_forward(run.role),
                progress=run.progress,
                replay=replay,
            )
            if replay is not None and records:
                shape = self._router_shape
                assert shape is not None
                self._recorded = replay.recorded_routing(run.microbatches, shape.num_moe_layers)
        finally:
            if replay is not None:
                replay.close()
        return out

    def recorded_routing(self) -> list[torch.Tensor]:
        """`RecordsRouting`: the experts the last policy forward-only pass recorded (R2), per
        microbatch ``[T, moe_layers, top_k]`` int32 (every stage's layers, on every rank)."""
        if self._recorded is None:
            raise RuntimeError(
                "recorded_routing: no policy forward-only pass recorded (routing_replay: record)"
            )
        out, self._recorded = self._recorded, None
        return out

    def _replay(self, routing: RoutingReplay) -> ScheduleReplay | None:
        """The policy's routers for one schedule call of a pass whose spec's routing is
        ``routing`` (None: they route freely)."""
        if routing == "off" or self._router_shape is None:
            return None
        return ScheduleReplay(
            self.policy.chunks, self.policy.hf_config, self.topology, record=routing == "record"
        )

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        replay = self._replay(run.spec.routing)
        try:
            return self._train(run, replay)
        finally:
            if replay is not None:
                replay.close()

    def _train(
        self, run: TrainingPass, replay: ScheduleReplay | None
    ) -> list[Mapping[str, Metric]]:
        staged = self.topology.pp_size > 1
        return self.loop.train(
            self.policy,
            run.microbatches,
            loss_fn=run.loss_fn,
            spec=run.spec,
            on_forward=lambda: self._count_forward("policy"),
            progress=run.progress,
            router_logits=self._router_logits and not staged,
            # under pp > 1 each stage adds its layers' share itself, with the coefficients of
            # the step's loss (its config, not the one this backend was built with)
            stage_router=self._stage_router(run) if self._router_logits and staged else None,
            replay=replay,
        )

    def _stage_router(self, run: TrainingPass) -> Any:
        """The step's router settings (`unirl.core.moe_loss.LossWithRouterTerm.router`); a loss
        without them is refused, not trained without its router term."""
        router = getattr(run.loss_fn, "router", None)
        if router is None:
            raise ConfigError(
                "forward_backward on a mixture-of-experts policy with parallel.pp > 1 needs the "
                "loss as unirl.core.moe_loss.LossWithRouterTerm (its .router holds the step's "
                "router-loss coefficients); wrap the loss function in it"
            )
        return router

    def optimizer_step(self) -> OptimizerStepStats:
        return self.policy.optimizer_step()

    def set_step_settings(self, settings: AdamStepSettings) -> None:
        """`unirl.core.backend.TakesStepSettings` (the policy's optimizer): the LR schedule no
        longer decides; the settings are written before each step (`apply_step_settings`)."""
        self.policy.step_settings = settings

    # -- state -------------------------------------------------------------------------------

    def _extra_models(self) -> dict[str, checkpoint.ExtraModel]:
        return {} if self.critic is None else {"critic": self.critic.model.saved()}

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None:
        checkpoint.save_checkpoint(
            Path(path),
            self.policy.ddp,
            self.policy.optimizer,
            self.topology,
            client_state=client_state,
            steps_done=self.policy.steps_done,
            extra=self._extra_models(),
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        client, steps_done, extra_steps = checkpoint.load_checkpoint(
            Path(path),
            self.policy.ddp,
            self.policy.optimizer,
            self.topology,
            extra=self._extra_models(),
        )
        if self.critic is not None:
            self.critic.model.after_load(extra_steps["critic"])
        self.policy.after_load(steps_done)
        return client

    def export_hf(self, path: Path) -> None:
        self.policy.export_hf(path)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights in Hugging Face names, on the CPU, on every rank
        (collective: TP all-gathers and PP broadcasts); under LoRA merged with the adapter."""
        return self.policy.hf_state_dict()

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """`TrainsAdapter`: the LoRA adapter in PEFT names, whole, on every rank (collective)."""
        self._need_adapter("adapter_state_dict")
        return self.policy.adapter_state_dict()

    def stream_base_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """`TrainsAdapter`: the frozen base weights (the adapter left out), streamed as
        `stream_weights` streams the merged ones: what a rollout engine keeps under LoRA."""
        self._need_adapter("stream_base_weights")
        return self.policy.stream_weights(bucket_bytes, dst=dst, device=device, merged=False)

    def export_adapter(self, path: Path) -> None:
        """`TrainsAdapter`: rank 0 writes the adapter as a PEFT folder (collective)."""
        lora = self._need_adapter("export_adapter")
        state = self.adapter_state_dict()
        if self.topology.rank == 0:
            write_peft_folder(state, lora, Path(path), base_model=self.cfg.model.path)
        if dist.is_initialized():
            dist.barrier()

    def _need_adapter(self, what: str) -> Any:
        if self.cfg.model.lora is None:
            raise ConfigError(f"{what} needs model.lora (this run trains the full weights)")
        return self.cfg.model.lora

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        """The policy's weights in buckets on ``device`` from their pipeline stages (collective:
        TP / EP all-gathers per parameter, a pipeline broadcast per bucket)."""
        return self.policy.stream_weights(bucket_bytes, dst=dst, device=device)

    def non_finite_weight(self) -> str | None:
        return self.policy.non_finite_weight()

    def close(self) -> None:
        """Free the models and optimizers and megatron's parallel state; destroy the process
        group only if this backend created it."""
        if self._closed:
            return
        self._closed = True
        self.policy.close()
        self._reference = None
        if self.critic is not None:
            self.critic.close()
        if dist.is_initialized():
            dist.barrier()
        release_parallel_state()
        destroy_process_group(self._process_group)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
