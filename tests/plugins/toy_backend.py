"""A backend that lives in the test suite, not in unirl: proof that a new engine plugs in without
an edit under ``unirl/core``.

`ToyBackend` trains a hand-written causal LM (token embedding -> tanh -> output layer: every
position sees only its own token, which is causal) in one process with plain PyTorch AdamW.
It implements `InstrumentedBackend` and registers as ``backend: toy`` with its own config section
(``toy: {hidden_size: ...}``) and its own rule (one process, no model parallelism).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from tests.tiny_models import TINY_BATCH
from unirl.backends.base import EngineBackend, ForwardOnlyPass, TrainingPass
from unirl.backends.hf.loop import LogprobHead, forward_only_pass, training_pass
from unirl.backends.hf.model import PackedModule
from unirl.core.backend import OptimizerStepStats
from unirl.core.config.run_config import UnirlConfig
from unirl.core.errors import ConfigError
from unirl.core.maths.losses import Metric
from unirl.core.protocols.backend_plugin import BackendPlugin
from unirl.core.topology import Topology
from unirl.core.weights.stream import (
    HOST,
    WeightBuckets,
    bucketed,
    checked_stream,
    first_non_finite_local,
)


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


class ToyModel(PackedModule):
    """A `ToyLM` as the shared microbatch loop drives it (`unirl.backends.hf.loop`): the loop
    is written zero times here. One process, gradients summed over microbatches by autograd."""

    def __init__(self, module: ToyLM) -> None:
        super().__init__(module, device=torch.device("cpu"), run=lambda m, mb: m(mb.tokens))

    def train(self) -> None:
        self.module.train()

    def loss_scale(self, num_microbatches: int) -> float:
        return 1.0  # nothing to cancel

    def begin_microbatch(self, *, last: bool) -> None:
        """No accumulation boundary to mark."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()


def check(cfg: UnirlConfig) -> None:
    p = cfg.parallel
    if (p.tp, p.pp, p.cp) != (1, 1, 1):
        raise ConfigError(
            f"parallel.tp/pp/cp = {p.tp}/{p.pp}/{p.cp}: backend: toy has no model parallelism; "
            "set them to 1"
        )
    if cfg.model.hf_config is None or "vocab_size" not in cfg.model.hf_config:
        raise ConfigError("backend: toy needs model.hf_config.vocab_size (it builds its own model)")


class ToyBackend(EngineBackend):
    """The shared `EngineBackend` base checks the calls and counts forwards, the shared loop runs
    the microbatches; this class holds only the models and the state."""

    def __init__(
        self, cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> None:
        super().__init__()
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
        self._models = {"policy": ToyModel(self.model), "reference": ToyModel(self.reference)}
        o = cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=0.0
        )

    def loss_scale(self, num_microbatches: int) -> float:
        return self._models["policy"].loss_scale(num_microbatches)

    def _forward_logprobs(self, run: ForwardOnlyPass) -> list[torch.Tensor]:
        return forward_only_pass(
            self._models[run.role],
            LogprobHead(None, run.spec),
            run.microbatches,
            progress=run.progress,
            count=lambda: self._count_forward(run.role),
        )

    def _forward_backward(self, run: TrainingPass) -> list[Mapping[str, Metric]]:
        return training_pass(
            self._models["policy"],
            LogprobHead(None, run.spec),
            run.microbatches,
            loss=lambda mb, out: run.loss_fn(mb, out.values, out.entropy),
            progress=run.progress,
            count=lambda: self._count_forward("policy"),
        )

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

    def stream_weights(
        self, bucket_bytes: int, *, dst: int | None, device: torch.device = HOST
    ) -> WeightBuckets:
        def stream() -> WeightBuckets:
            weights = self.hf_state_dict().items()
            return bucketed(((k, v.to(device)) for k, v in weights), bucket_bytes)

        return checked_stream(self.non_finite_weight, stream)

    def non_finite_weight(self) -> str | None:
        return first_non_finite_local(self.model.named_parameters())

    def close(self) -> None:
        pass


def build(
    cfg: UnirlConfig, *, total_optimizer_steps: int, needs_reference: bool = False
) -> ToyBackend:
    return ToyBackend(
        cfg, total_optimizer_steps=total_optimizer_steps, needs_reference=needs_reference
    )


PLUGIN = BackendPlugin(name="toy", options=ToyOptions, build=build, check=check)


def config_data(vocab: int, **sections: Any) -> dict[str, Any]:
    """The smallest config that trains on ``backend: toy`` (one process, a vocabulary of
    ``vocab``, two microbatches of 2); ``sections`` add or replace whole sections."""
    return {
        "backend": "toy",
        "toy": {"hidden_size": 8},
        "model": {"hf_config": {"vocab_size": vocab}, "init_seed": 3, "max_seq_len": 16},
        "optimizer": {"lr": 0.1, "grad_clip": None},
        "batch": dict(TINY_BATCH),
        "parallel": {"world_size": 1},
        "progress": {"enabled": False},
    } | sections
