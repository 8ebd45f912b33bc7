"""The experts a Hugging Face mixture-of-experts model routes each token of finished samples to,
as the data contract's ``routed_experts`` (``[prompt + response - 1, moe_layers, top_k]``,
`unirl.core.data.routed_experts`): what a rollout engine that returns its routing hands over for
``algorithm.routing_replay: rollout`` (R3).

It exists because vLLM's CPU build cannot return routed experts (see the README, "Routing
replay"): a rollout file written here feeds R3 from the file source instead, from the model that
sampled it (`write_moe_rollouts`), or from any other copy of it, e.g. one whose numerics differ.

One forward per sample over its prompt and response tokens, with a forward hook on every MoE
router (``Qwen3MoeTopKRouter``, in module order = MoE-layer order) that keeps its top-k indices.
Under the causal mask token ``j``'s routing depends on tokens ``<= j`` only, so these are the
experts an engine that read the same tokens one by one (prefill, then decode) chose, up to its
floating-point order; the last token's row is dropped (it is never read).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import attrs
import torch
from torch import nn

from unirl.core.config.run_config import UnirlConfig
from unirl.core.data.rollout import RolloutSample
from unirl.core.data.rollout_io import write_rollouts
from unirl.core.data.routed_experts import DTYPE
from unirl.core.errors import ConfigError
from unirl.rollouts.build import sample_task_rollouts


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in module order (the i-th is MoE layer i); raises `ConfigError`
    for a model with none this module knows."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    routers = [m for m in model.modules() if isinstance(m, Qwen3MoeTopKRouter)]
    if not routers:
        raise ConfigError(
            f"routed experts: {type(model).__name__} has no Qwen3-MoE router; routing replay "
            "needs a Qwen3-MoE model (model.hf_config.model_type: qwen3_moe)"
        )
    return routers


class _Capture:
    """Forward hooks keeping each router's top-k indices of the last forward."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.indices: dict[int, torch.Tensor] = {}

    def __enter__(self) -> _Capture:
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            self.indices[layer] = output[2].detach()  # (logits, weights, indices)

        return hook

    def experts(self) -> torch.Tensor:
        """``[tokens, moe_layers, top_k]`` of the last forward."""
        return torch.stack([self.indices[i] for i in range(len(self.routers))], dim=1)


@torch.no_grad()
def capture_routed_experts(
    model: nn.Module, samples: Sequence[RolloutSample]
) -> Iterator[RolloutSample]:
    """Each sample with ``routed_experts`` set to the experts ``model`` routes its tokens to
    (every token but the last), in the contract's shape and dtype."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with _Capture(model) as capture:
            for sample in samples:
                tokens = [*sample.prompt_tokens, *sample.response_tokens.tolist()]
                model(input_ids=torch.tensor([tokens], device=device))
                experts = capture.experts()[:-1].to(device="cpu", dtype=DTYPE)
                yield attrs.evolve(sample, routed_experts=experts)
    finally:
        model.train(was_training)


def write_moe_rollouts(
    path: str | os.PathLike[str],
    cfg: UnirlConfig,
    n_rollouts: int,
    seed: int,
    *,
    hf_model: nn.Module,
) -> int:
    """`unirl.rollouts.build.write_task_rollouts` with ``routed_experts``: ``n_rollouts``
    rollouts of ``rollout.task`` sampled by ``hf_model``, with its rollout log-probs and the
    experts it routes each sample's tokens to. Returns the number of samples written."""
    samples = sample_task_rollouts(cfg, n_rollouts, seed, hf_model=hf_model)
    write_rollouts(path, list(capture_routed_experts(hf_model, samples)))
    return len(samples)
