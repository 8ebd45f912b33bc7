"""`Fsdp2Backend`: unirl's `TrainingBackend` on PyTorch FSDP2 (`fully_shard`) with a Hugging Face
model, optionally with Ulysses sequence parallel.

One optimizer step, as core's RL step drives it::

    backend = Fsdp2Backend(cfg, total_optimizer_steps=n, needs_reference=kl_on)
    old = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)   # if recompute
    metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
    stats = backend.optimizer_step()            # grad norm before clipping, lr used

The only loss arithmetic here is `loss_scale`. Core losses are normalised by the global counts of
the optimizer step, so the objective is the SUM of the local losses over microbatches and ranks
(data- and sequence-parallel: SP ranks hold disjoint tokens of the same sequences). Gradients
accumulate over microbatches by plain summation, and FSDP2's reduce-scatter (and, under hybrid
sharding, the all-reduce over replicas) AVERAGES them over all ``dp x sp`` ranks; multiplying
each loss by the world size turns that average back into the sum.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from unirl.backends.base import EngineBackend, ForwardOnlyPass, TrainingPass
from unirl.backends.forward_only import forward_only
from unirl.backends.fsdp2 import checkpoint, export, packed
from unirl.backends.fsdp2.engine import build_optimizer, shard_model
from unirl.backends.fsdp2.plugin import Fsdp2Options
from unirl.backends.fsdp2.topology import build_mesh
from unirl.backends.fused_head import FusedLMHead, install_fused_head, packed_logprobs
from unirl.backends.hf_model import load_policy, load_reference, torch_dtype
from unirl.backends.microbatch import to_device, zero_through_graph
from unirl.backends.process_group import destroy_process_group, init_process_group
from unirl.core.backend import ModelRole, OptimizerStepStats
from unirl.core.maths.losses import Metric
from unirl.core.run.config import UnirlConfig

logger = logging.getLogger(__name__)


class Fsdp2Backend(EngineBackend):
    """See the module docstring."""

    def __init__(
        self,
        cfg: UnirlConfig,
        *,
        total_optimizer_steps: int,
        needs_reference: bool = False,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.fsdp: Fsdp2Options = cfg.backend_options
        fsdp = self.fsdp
        self._dist = init_process_group(cfg.parallel)
        self.device = self._dist.device
        self._mesh = build_mesh(fsdp, self._dist.rank, self._dist.world_size, self.device)
        self.topology = self._mesh.topology
        model = load_policy(cfg.model)
        packed.use_attention(model, fsdp.sp)
        # model.fused_head: the LM head computes the log-probs (no [T, V] logits)
        self._heads: dict[ModelRole, FusedLMHead | None] = {
            "policy": install_fused_head(model) if cfg.model.fused_head else None
        }
        self.vocab_size = int(model.config.vocab_size)
        self.model = shard_model(
            model,
            self._mesh.shard_mesh,
            fsdp,
            dtype=cfg.model.dtype,
            device=self.device,
            train=True,
        )
        self.optimizer, self._scheduler = build_optimizer(
            self.model, cfg, total_steps=total_optimizer_steps
        )
        self._reference: Any = None
        self._closed = False
        if needs_reference:
            self._reference_module()

    def loss_scale(self, num_microbatches: int) -> float:
        """Cancels FSDP2's mean over all ``dp x sp`` ranks (see the module docstring); the
        microbatches' gradients are summed, so their number does not enter."""
        return float(self.topology.world_size)

    @property
    def _sp_group(self) -> Any:
        return self.topology.groups.cp

    # -- forward passes ----------------------------------------------------------------------

    def _reference_module(self) -> Any:
        if self._reference is None:
            ref = load_reference(self.cfg.model)
            packed.use_attention(ref, self.fsdp.sp)
            self._heads["reference"] = (
                install_fused_head(ref) if self.cfg.model.fused_head else None
            )
            ref_fsdp = attrs.evolve(self.fsdp, cpu_offload=self.cfg.model.ref_offload)
            self._reference = shard_model(
                ref,
                self._mesh.shard_mesh,
                ref_fsdp,
                dtype=self.cfg.model.dtype,
                device=self.device,
                train=False,
            )
        return self._reference

    @contextlib.contextmanager
    def _forward_only(self, role: ModelRole) -> Iterator[Any]:
        module = self.model if role == "policy" else self._reference_module()
        # an offloaded reference stays in CPU memory: FSDP2's offload policy moves each layer in
        with forward_only([module], device=self.device):
            yield module

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        """Detached fp32 log-probs ``[T]`` (SP-local) per microbatch, on the device."""
        microbatches, role, spec, progress = run.microbatches, run.role, run.spec, run.progress
        out = []
        with self._forward_only(role) as module:
            for mb in microbatches:
                mb = to_device(mb, self.device)
                logp, _, _ = packed_logprobs(
                    lambda m: packed.forward(module, m, self.device, self._sp_group),
                    self._heads[role],
                    mb,
                    spec,
                )
                self._count_forward(role)
                out.append(logp.float())
                progress.report(tokens=mb.num_tokens)
                progress.tick()
        return out

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        """Accumulate the gradients of every microbatch of one optimizer step (each backward
        reduce-scatters its gradients into the sharded ``.grad``, which sums over microbatches)."""
        microbatches, loss_fn, spec, progress = (
            run.microbatches,
            run.loss_fn,
            run.spec,
            run.progress,
        )
        self.model.train()
        scale = self.loss_scale(len(microbatches))
        metrics = []
        for mb in microbatches:
            mb = to_device(mb, self.device)
            logp, entropy, out = packed_logprobs(
                lambda m: packed.forward(self.model, m, self.device, self._sp_group),
                self._heads["policy"],
                mb,
                spec,
            )
            self._count_forward("policy")
            loss, mb_metrics = loss_fn(mb, logp, entropy)
            if mb.num_tokens == 0:
                # this rank's backward must run the same reduce-scatters as the others'
                loss = loss + zero_through_graph(out)
            (loss * scale).backward()
            metrics.append(mb_metrics)
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            progress.tick()
        return metrics

    # -- optimizer ---------------------------------------------------------------------------

    def optimizer_step(self) -> OptimizerStepStats:
        """Clip, step, advance the LR schedule; the norm is the global one before clipping."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.cfg.optimizer.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip else math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm over every shard
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return OptimizerStepStats(grad_norm=grad_norm, lr=lr, skipped=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._scheduler.step()
        return OptimizerStepStats(grad_norm=grad_norm, lr=lr)

    # -- state -------------------------------------------------------------------------------

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None:
        checkpoint.save_checkpoint(
            self.model,
            self.optimizer,
            self._scheduler,
            Path(path),
            client_state,
            rank=self._dist.rank,
            world_size=self._dist.world_size,
            meta={"sp": self.fsdp.sp, "sharding": self.fsdp.sharding},
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return checkpoint.load_checkpoint(
            self.model,
            self.optimizer,
            self._scheduler,
            Path(path),
            rank=self._dist.rank,
            world_size=self._dist.world_size,
        )

    def export_hf(self, path: Path) -> None:
        export.export_hf(
            self.model,
            self.cfg.model,
            torch_dtype(self.cfg.model),
            Path(path),
            rank=self._dist.rank,
        )

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights in Hugging Face names and the model's dtype, on the CPU, on
        every rank (collective)."""
        return export.hf_state_dict(self.model, torch_dtype(self.cfg.model))

    def close(self) -> None:
        """Drop the models; destroy the process group only if this backend created it."""
        if self._closed:
            return
        self._closed = True
        self.model = None  # type: ignore[assignment]
        self.optimizer = None  # type: ignore[assignment]
        self._reference = None
        destroy_process_group(self._dist)
