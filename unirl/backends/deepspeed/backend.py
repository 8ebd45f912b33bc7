"""`DeepSpeedBackend`: unirl's `TrainingBackend` on DeepSpeed ZeRO 0-3 with a Hugging Face model.

One optimizer step, as core's RL step drives it::

    backend = DeepSpeedBackend(cfg, total_optimizer_steps=n, needs_reference=kl_on)
    old = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)   # if recompute
    metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
    stats = backend.optimizer_step()            # grad norm before clipping, lr used

The only loss arithmetic here is `loss_scale`. Core losses are normalised by the global counts of
the optimizer step, so the objective is the SUM of the microbatch losses over microbatches and
data-parallel ranks. Gradients accumulate over microbatches by plain summation
(``scale_wrt_gas=False``), and DeepSpeed then AVERAGES them over the dp ranks; multiplying each
loss by ``dp`` turns that average back into the sum.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from unirl.backends.base import EngineBackend, ForwardOnlyPass, TrainingPass
from unirl.backends.deepspeed import checkpoint, export
from unirl.backends.deepspeed.distributed import close_distributed, init_distributed
from unirl.backends.deepspeed.engine import initialize_policy, initialize_reference
from unirl.backends.deepspeed.packed import forward_packed, use_packed_attention
from unirl.backends.deepspeed.topology import deepspeed_topology
from unirl.backends.forward_only import forward_only
from unirl.backends.fused_head import FusedLMHead, install_fused_head, packed_logprobs
from unirl.backends.hf_model import load_policy, load_reference
from unirl.backends.microbatch import to_device, zero_through_graph
from unirl.core.backend import ModelRole, OptimizerStepStats
from unirl.core.maths.losses import Metric
from unirl.core.run.config import UnirlConfig

logger = logging.getLogger(__name__)


class DeepSpeedBackend(EngineBackend):
    """See the module docstring."""

    def __init__(
        self, cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self._dist = init_distributed(cfg.parallel)
        self.topology = deepspeed_topology(self._dist.rank, self._dist.world_size)
        model = load_policy(cfg.model)
        use_packed_attention(model)
        # model.fused_head: the LM head computes the log-probs (no [T, V] logits)
        self._heads: dict[ModelRole, FusedLMHead | None] = {
            "policy": install_fused_head(model) if cfg.model.fused_head else None
        }
        self.vocab_size = int(model.config.vocab_size)
        self.engine, self._scheduler = initialize_policy(
            model, cfg, total_steps=total_optimizer_steps, dp_size=self.topology.dp_size
        )
        if self.topology.dp_size == 1 and cfg.parallel.zero_stage == 0:
            # One data-parallel rank: DeepSpeed would still flatten every gradient, all-reduce
            # it over a group of one and copy it back after each backward on the boundary.
            self.engine.enable_backward_allreduce = False
        self.device = torch.device(self.engine.device)
        self._reference: Any = None
        self._closed = False
        if needs_reference:
            self._reference_module()

    # -- properties --------------------------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The Hugging Face module being trained (parameters partitioned under ZeRO-3)."""
        return self.engine.module

    def loss_scale(self, num_microbatches: int) -> float:
        """Cancels DeepSpeed's mean over data-parallel ranks (see the module docstring); the
        microbatches are summed (``scale_wrt_gas=False``), so their number does not enter."""
        return float(self.topology.dp_size)

    # -- forward passes ----------------------------------------------------------------------

    def _reference_module(self) -> Any:
        if self._reference is None:
            ref = load_reference(self.cfg.model)
            use_packed_attention(ref)
            self._heads["reference"] = (
                install_fused_head(ref) if self.cfg.model.fused_head else None
            )
            self._reference = initialize_reference(ref, self.cfg, self.device)
        return self._reference

    @contextlib.contextmanager
    def _forward_only(self, role: ModelRole) -> Iterator[Any]:
        """The module of `role` in eval mode, on the device (an offloaded reference is moved in
        for the pass and back out after it)."""
        module = self.engine if role == "policy" else self._reference_module()
        offloaded = (
            role == "reference" and self.cfg.model.ref_offload and self.cfg.parallel.zero_stage != 3
        )
        with forward_only([module], device=self.device, offloaded=offloaded):
            yield module

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        microbatches, role, spec, progress = run.microbatches, run.role, run.spec, run.progress
        out = []
        with self._forward_only(role) as module:
            for mb in microbatches:
                mb = to_device(mb, self.device)
                logp, _, _ = packed_logprobs(
                    lambda m: forward_packed(module, m, self.device), self._heads[role], mb, spec
                )
                self._count_forward(role)
                out.append(logp.float())
                progress.report(tokens=mb.num_tokens)
                progress.tick()
        return out

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        microbatches, loss_fn, spec, progress = (
            run.microbatches,
            run.loss_fn,
            run.spec,
            run.progress,
        )
        self.engine.train()
        metrics = []
        last = len(microbatches) - 1
        scale = self.loss_scale(len(microbatches))
        for i, mb in enumerate(microbatches):
            mb = to_device(mb, self.device)
            # Reduce (ZeRO 0/1) / finish the partitioned reduction (ZeRO 2/3) on the last one.
            self.engine.set_gradient_accumulation_boundary(i == last)
            logp, entropy, out = packed_logprobs(
                lambda m: forward_packed(self.engine, m, self.device),
                self._heads["policy"],
                mb,
                spec,
            )
            self._count_forward("policy")
            loss, mb_metrics = loss_fn(mb, logp, entropy)
            if mb.num_tokens == 0:
                loss = loss + zero_through_graph(out)  # ZeRO's gradient hooks still fire
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            metrics.append(mb_metrics)
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            progress.tick()
        return metrics

    # -- optimizer ---------------------------------------------------------------------------

    def _local_grad_norm(self) -> float:
        """The norm of the module's (already all-reduced) gradients: DeepSpeed reports none
        without ZeRO and without bf16 (client optimizer path)."""
        grads = [
            p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None
        ]
        if not grads:
            return 0.0
        return float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        )

    def optimizer_step(self) -> OptimizerStepStats:
        """Clip, step, advance the LR schedule; the norm is the global one before clipping."""
        lr = float(self.engine.get_lr()[0])
        plain = self.engine.zero_optimization_stage() == 0 and not self.engine.bfloat16_enabled()
        own_norm = self._local_grad_norm() if plain else None
        if own_norm is not None and not math.isfinite(own_norm):
            # DeepSpeed's plain path would apply it: skip, as ZeRO does on a non-finite norm.
            logger.warning("non-finite gradient norm %s: optimizer step skipped", own_norm)
            self.engine.zero_grad()
            return OptimizerStepStats(grad_norm=own_norm, lr=lr, skipped=True)
        self.engine.step()
        norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()
        if norm is None:
            raise RuntimeError(
                "DeepSpeed reported no gradient norm after the step (ZeRO gradient-norm "
                "computation disabled in deepspeed.extra?)"
            )
        return OptimizerStepStats(
            grad_norm=float(norm), lr=lr, skipped=not self.engine.was_step_applied()
        )

    # -- state -------------------------------------------------------------------------------

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None:
        checkpoint.save_checkpoint(
            self.engine,
            Path(path),
            client_state,
            rank=self._dist.rank,
            world_size=self._dist.world_size,
        )

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        return checkpoint.load_checkpoint(
            self.engine, Path(path), rank=self._dist.rank, world_size=self._dist.world_size
        )

    def export_hf(self, path: Path) -> None:
        export.export_hf(self.engine, self.cfg.model, Path(path), rank=self._dist.rank)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights in Hugging Face names, on the CPU, on every rank
        (collective under ZeRO-3)."""
        return export.hf_state_dict(self.engine)

    def close(self) -> None:
        """Free the engines; destroy the process group only if this backend created it."""
        if self._closed:
            return
        self._closed = True
        self.engine.destroy()
        if self._reference is not None and hasattr(self._reference, "destroy"):
            self._reference.destroy()
        self._reference = None
        close_distributed(self._dist)
