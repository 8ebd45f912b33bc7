"""The LoRA contract's independent reference: transformers + peft in fp32, one process, no unirl
code. The policy is ``peft.PeftModel.from_pretrained(base, start adapter, is_trainable=True)``
(peft's own LoRA forward), the reference model is the plain base; the loss of the step is
`tests.contract.reference.step_loss` (the papers' formulas, per token), the gradient norm and
clipping are over the adapter's parameters only, and the update is `torch.optim.AdamW` over them
(weight decay on every adapter matrix: unirl's convention for 2-D parameters).

The start adapter is written here with peft (`write_start_adapter`): A and B random, so the
gradient of A (``B^T`` times the output gradient) is not zero as it is from peft's B = 0 init.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tests.contract.reference import (
    CLIP_EPS,
    F32,
    Settings,
    batch_logprobs,
    batch_metrics,
    load_model,
    step_loss,
)

RANK = 4
ALPHA = 8.0
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
ADAPTER_SEED = 99
ADAPTER_STD = 0.2


def lora_section(adapter: str | Path) -> dict[str, Any]:
    """The ``model.lora`` section of the contract's runs (a plain dict, as a user writes it)."""
    return {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS, "path": str(adapter)}


def write_start_adapter(model_dir: str | Path, out: Path) -> Path:
    """A PEFT folder (peft's ``save_pretrained``) with seeded random A and B."""
    import peft

    model = load_model(model_dir)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS)
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(ADAPTER_SEED)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * ADAPTER_STD)
    wrapped.save_pretrained(out)
    return out


def load_adapted(model_dir: str | Path, adapter: str | Path, *, trainable: bool) -> Any:
    import peft

    model = load_model(model_dir)
    return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)


class LoraReference:
    """The adapted policy stepping with AdamW over its adapter; the base model as reference."""

    def __init__(self, model_dir: str | Path, adapter: str | Path, cfg: Mapping[str, Any]) -> None:
        self.s = Settings(cfg)
        self.base = load_model(model_dir)
        self.model = self.load(model_dir, adapter)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.gradients: dict[str, torch.Tensor] = {}
        self.opt = torch.optim.AdamW(
            self.params,
            lr=self.s.lr,
            betas=self.s.betas,
            eps=self.s.eps,
            weight_decay=self.s.weight_decay,
        )

    def logprobs(self, records: list[Mapping[str, Any]]) -> list[torch.Tensor]:
        return batch_logprobs(self.model, records, self.s.temperature)

    def base_logprobs(self, records: list[Mapping[str, Any]]) -> list[torch.Tensor]:
        return batch_logprobs(self.base, records, self.s.temperature)

    def step(self, records: list[Mapping[str, Any]]) -> dict[str, Any]:
        """One RL step: the KL term against the base model's log-probs (the records carry no
        reference log-probs), the norm and clip over the adapter alone."""
        s = self.s
        ref = self.base_logprobs(records) if s.kl_coef else None
        self.opt.zero_grad(set_to_none=False)
        loss, metrics = step_loss(self.model, records, s, ref)
        router = self.router_term(records)
        if router is not None:
            term, router_metrics = router
            loss = loss + term  # trained on; the "loss" metric stays the policy's (unirl's)
            metrics.update(router_metrics)
        loss.backward()
        frozen_grads = [
            n
            for n, p in self.model.named_parameters()
            if p.grad is not None and not p.requires_grad
        ]
        assert not frozen_grads, frozen_grads
        self.gradients = self.state(lambda p: p.grad)  # before clipping
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in self.params))
        coef = min(1.0, s.grad_clip / (norm + CLIP_EPS))
        with torch.no_grad():
            for p in self.params:
                p.grad.mul_(coef)
        self.opt.step()
        metrics.update(batch_metrics(records))
        metrics.update(
            {
                "grad_norm": norm,
                "lr": s.lr,
                "skipped_steps": 0.0,
                "optimizer_steps": 1.0,
                "old_logprobs/recompute": float(s.old_logprobs == "recompute"),
            }
        )
        return {"metrics": metrics, "clipped": coef < 1.0}

    def load(self, model_dir: str | Path, adapter: str | Path) -> Any:
        """The adapted policy, trainable (peft's LoRA on the targets)."""
        return load_adapted(model_dir, adapter, trainable=True)

    def router_term(self, records: list[Mapping[str, Any]]) -> tuple[torch.Tensor, dict] | None:
        """A term the step adds to the policy loss, with its metrics (none on the dense model)."""
        return None

    def state(self, of: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapter's parameters (``of``: values or gradients) in PEFT's names (those of
        ``peft.get_peft_model_state_dict``: the parameter name without the adapter's)."""
        return {
            n.replace(".default", ""): of(p).detach().to(F32).clone()
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter in PEFT's names."""
        return self.state(lambda p: p)
