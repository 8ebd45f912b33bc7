"""The mixture-of-experts parts of the contract's reference, in plain transformers fp32 (no unirl
code): the router term of a step, routing forced to given experts, and the checkpoint names.

- **Router term** (what a Qwen3-MoE step adds to the policy loss, as the config sets it): each
  training microbatch ``m`` (the samples a backend packed into one forward) has ``aux_m``,
  transformers' own ``load_balancing_loss_func`` over the router logits of every token of its
  sequences (all MoE layers pooled), and ``z_m``, the mean over the same rows of
  ``logsumexp(logits)^2`` (ST-MoE eq. 5, written here); the step's term is
  ``sum_m (aux_coef aux_m + z_coef z_m) n_m / N`` with ``n_m`` the tokens of ``m`` and ``N`` those
  of the step. The balance statistic is per forward (as in transformers and Megatron), so the
  term depends on how the step is split into microbatches: the reference takes the split the
  backend ran (sample indices only; the numbers are all computed here).
- **Forced routing** (``routing_replay: rollout``): a forward hook on each layer's router
  replaces its top-k with the given experts (the last token of a sequence, which has no given
  row, keeps its own); the weights are the softmax probabilities at the forced experts,
  renormalised as ``norm_topk_prob`` says. The router logits, and so the router term, stay the
  router's own.
- **Names**: transformers keeps each layer's experts fused (``experts.gate_up_proj`` ``[E, 2I, H]``,
  ``experts.down_proj`` ``[E, H, I]``); checkpoints and the backends' exports name them per expert.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

F32 = torch.float32


def is_moe(model: torch.nn.Module) -> bool:
    return getattr(model.config, "model_type", None) == "qwen3_moe"


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def sequence_router_logits(model: torch.nn.Module, tokens: list[int]) -> list[torch.Tensor]:
    """Each MoE layer's router logits ``[S, E]`` over the tokens of one sequence."""
    out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    return [r.reshape(len(tokens), -1).to(F32) for r in out.router_logits]


def router_term(
    model: torch.nn.Module,
    records: Sequence[Mapping[str, Any]],
    splits: Sequence[Sequence[int]],
    *,
    aux_coef: float,
    z_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's router term (with autograd) and the metrics ``router/aux_loss`` /
    ``router/z_loss`` (token-weighted means over the microbatches), for the microbatch split
    ``splits`` (sample indices per training microbatch, every rank's)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = model.config
    tokens = [list(r["prompt_tokens"]) + list(r["response_tokens"]) for r in records]
    covered = sorted(i for mb in splits for i in mb)
    assert covered == list(range(len(records))), f"the split covers samples {covered}"
    total_tokens = sum(len(t) for t in tokens)
    term = torch.zeros((), dtype=F32)
    aux_sum = z_sum = 0.0
    for mb in splits:
        if not mb:
            continue  # an empty microbatch (equal counts on every rank) routes nothing
        per_layer: list[list[torch.Tensor]] = []
        for i in mb:
            for layer, rows in enumerate(sequence_router_logits(model, tokens[i])):
                if layer == len(per_layer):
                    per_layer.append([])
                per_layer[layer].append(rows)
        layers = tuple(torch.cat(rows) for rows in per_layer)
        aux = load_balancing_loss_func(layers, cfg.num_experts, cfg.num_experts_per_tok)
        z = torch.logsumexp(torch.cat(layers), dim=-1).square().mean()
        n = sum(len(tokens[i]) for i in mb)
        term = term + (aux_coef * aux + z_coef * z) * (n / total_tokens)
        aux_sum += aux.item() * n
        z_sum += z.item() * n
    metrics = {"router/aux_loss": aux_sum / total_tokens, "router/z_loss": z_sum / total_tokens}
    return term, metrics


class ForcedRouting:
    """Forward hooks that route every sequence ``model`` reads to the experts given for it
    (looked up by its token ids), and count how many given decisions differ from the router's
    own top-k (``router/disagreement``: differing / given token-layer decisions)."""

    def __init__(self, model: torch.nn.Module, experts: Mapping[tuple[int, ...], Any]) -> None:
        self.experts = {k: torch.as_tensor(v, dtype=torch.long) for k, v in experts.items()}
        self.current: torch.Tensor | None = None  # [rows, layers, top_k] of the running sequence
        self.differing = 0
        self.decisions = 0
        self.norm = bool(model.config.norm_topk_prob)
        model.register_forward_pre_hook(self._select, with_kwargs=True)
        for layer, router in enumerate(routers(model)):
            router.register_forward_hook(self._forcer(layer))

    def _select(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs["input_ids"]
        assert ids.shape[0] == 1, "the reference runs one sequence at a time"
        self.current = self.experts[tuple(ids[0].tolist())]

    def _forcer(self, layer: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            logits, _, own = output
            assert self.current is not None
            probs = torch.softmax(logits.to(F32), dim=-1)
            given = self.current[:, layer]
            chosen = own.clone()
            chosen[: given.shape[0]] = given  # the last token has no given row: its own top-k
            own_sets = own[: given.shape[0]].sort(dim=-1).values
            self.differing += int((own_sets != given.sort(dim=-1).values).any(-1).sum())
            self.decisions += given.shape[0]
            weights = probs.gather(1, chosen)
            if self.norm:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return hook

    def take_disagreement(self) -> float:
        value = self.differing / max(self.decisions, 1)
        self.differing = self.decisions = 0
        return value


def per_expert(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each fused experts tensor split into the checkpoint's per-expert names:
    ``gate_up_proj[e]`` = [gate_e; up_e], ``down_proj[e]`` = down_e."""
    out = {}
    for name, t in state.items():
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if m.group(2) == "gate_up_proj":
                gate, up = t[e].chunk(2)
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = gate
                out[f"{m.group(1)}.{e}.up_proj.weight"] = up
            else:
                out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
    return out
