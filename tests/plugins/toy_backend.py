"""A backend that lives in the test suite, not in unirl: proof that a new engine plugs in without
an edit under ``unirl/core``.

`ToyBackend` trains a hand-written causal LM (token embedding -> tanh -> output layer: every
position sees only its own token, which is causal) in one process with plain PyTorch AdamW.
It implements `InstrumentedBackend` and registers as ``backend: toy`` with its own config section
(``toy: {hidden_size: ...}``) and its own rule (one process, no model parallelism).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from unirl.backends.forward_only import forward_only
from unirl.backends.microbatch import to_device, zero_through_graph
from unirl.core.backend import (
    LogprobSpec,
    LossFn,
    ModelRole,
    OptimizerStepStats,
    token_logprobs,
)
from unirl.core.backend_plugin import BackendPlugin
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.errors import ConfigError
from unirl.core.maths.losses import Metric
from unirl.core.run.config import UnirlConfig
from unirl.core.run.progress import MicrobatchProgress
from unirl.core.topology import Topology


@attrs.frozen(kw_only=True)
class ToyOptions:
    """The ``toy:`` section."""

    hidden_size: int = 16


class ToyLM(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden_size)
        self.head = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, V]`` of a packed token stream ``[T]``."""
        return self.head(torch.tanh(self.embed(tokens)))


def check(cfg: UnirlConfig) -> None:
    p = cfg.parallel
    for key in ("tp", "pp", "cp"):
        if getattr(p, key) > 1:
            raise ConfigError(
                f"parallel.{key}={getattr(p, key)} is not supported with backend: toy (one "
                f"process, no model parallelism); set parallel.{key}: 1"
            )
    if cfg.model.hf_config is None or "vocab_size" not in cfg.model.hf_config:
        raise ConfigError("backend: toy needs model.hf_config.vocab_size (it builds its own model)")


class ToyBackend:
    def __init__(
        self, cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> None:
        assert cfg.model.hf_config is not None  # `check` made sure
        self.cfg = cfg
        self.topology = Topology.single_process()
        self.device = torch.device("cpu")
        self.vocab_size = int(cfg.model.hf_config["vocab_size"])
        torch.manual_seed(cfg.model.init_seed)
        self.model = ToyLM(self.vocab_size, cfg.backend_options.hidden_size)
        self.reference = ToyLM(self.vocab_size, cfg.backend_options.hidden_size)
        self.reference.load_state_dict(self.model.state_dict())
        self.reference.requires_grad_(False)
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=0.0
        )
        self.forward_calls: dict[ModelRole, int] = {"policy": 0, "reference": 0}

    def loss_scale(self, num_microbatches: int) -> float:
        return 1.0  # one process, gradients summed over microbatches: nothing to cancel

    def forward_logprobs(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        role: ModelRole,
        spec: LogprobSpec,
        progress: MicrobatchProgress,
    ) -> list[torch.Tensor]:
        module = self.model if role == "policy" else self.reference
        spec = attrs.evolve(spec, with_entropy=False, entropy_grad=False)
        out = []
        with forward_only([module], device=self.device):
            for mb in microbatches:
                mb = to_device(mb, self.device)
                logp, _ = token_logprobs(module(mb.tokens), mb.targets, spec)
                self.forward_calls[role] += 1
                out.append(logp.float())
                progress.tick()
        return out

    def forward_backward(
        self,
        microbatches: Sequence[TrainMicrobatch],
        *,
        loss_fn: LossFn,
        spec: LogprobSpec,
        progress: MicrobatchProgress,
    ) -> list[Mapping[str, Metric]]:
        self.model.train()
        metrics = []
        scale = self.loss_scale(len(microbatches))
        for mb in microbatches:
            mb = to_device(mb, self.device)
            logits = self.model(mb.tokens)
            self.forward_calls["policy"] += 1
            logp, entropy = token_logprobs(logits, mb.targets, spec)
            loss, mb_metrics = loss_fn(mb, logp, entropy)
            if mb.num_tokens == 0:
                loss = loss + zero_through_graph(logits)
            (loss * scale).backward()
            metrics.append(mb_metrics)
            progress.report(loss=loss.detach(), tokens=mb.num_tokens)
            progress.tick()
        return metrics

    def optimizer_step(self) -> OptimizerStepStats:
        clip = self.cfg.optimizer.grad_clip or math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return OptimizerStepStats(grad_norm=norm, lr=self.cfg.optimizer.lr)

    def save_checkpoint(self, path: Path, client_state: Mapping[str, Any]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "client": dict(client_state),
        }
        torch.save(state, Path(path) / "toy.pt")

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        state = torch.load(Path(path) / "toy.pt", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return state["client"]

    def export_hf(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(self.hf_state_dict(), Path(path) / "weights.pt")

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def close(self) -> None:
        pass


def build(
    cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
) -> ToyBackend:
    return ToyBackend(
        cfg, total_optimizer_steps=total_optimizer_steps, needs_reference=needs_reference
    )


PLUGIN = BackendPlugin(name="toy", options=ToyOptions, build=build, check=check)
