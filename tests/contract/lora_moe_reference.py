"""The LoRA contract's reference for expert adapters (``model.lora.target_experts`` on the tiny
Qwen3-MoE): transformers in fp32, one process, no unirl code, in the per-expert, per-projection
form Megatron trains and vLLM serves (an A and a B for each expert's gate, up and down
projection).

peft cannot stand for that form here: transformers 5 holds a layer's experts as two fused 3-D
tensors (``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``) and peft's
``target_parameters`` adapts ``gate_up_proj`` with one A for gate and up together (rank 2r, B
full), a different adapter class. So peft adapts the attention's linears as in the dense
reference, and `LoraExperts`, written here, replaces each layer's experts module: transformers'
eager loop over the experts with each projection's ``x W^T + scale * (x A_p,e^T) B_p,e^T``
(``W`` gate's rows ``gate_up_proj[e][:F]``, up's ``[F:]``). The start adapter's expert tensors
are written under the per-expert PEFT names Megatron reads and exports
(``...mlp.experts.{e}.gate_proj.lora_A.weight``).

The step (`tests.contract.lora_reference.LoraReference`) adds the router's z-loss
(`ROUTER_COEFS`): with the router frozen its gradient reaches the adapters through the hidden
states (the adapter's gradient norm is 1.83 with it, 1.07 from the policy loss alone). The
load-balancing term stays out (coefficient 0): it is a per-forward statistic, so the step would
depend on the microbatch split and clause L4 (the same step split otherwise) could not hold; its
value and gradient are the MoE contract's router clause.

Checked once by hand: on the start adapter this reference's log-probs equal those of
``peft.PeftModel.from_pretrained`` on the same folder (peft's own mapping of per-expert adapters
onto the fused experts) within 1.5e-6.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from tests.contract import moe_reference
from tests.contract.lora_reference import ADAPTER_SEED, ADAPTER_STD, ALPHA, RANK, LoraReference
from tests.contract.reference import F32, load_model

# Attention as in the dense contract (q and v of the fused qkv, not k), every expert projection.
ATTENTION_TARGETS = ["q_proj", "v_proj", "o_proj"]
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
TARGETS = [*ATTENTION_TARGETS, *EXPERT_PROJECTIONS]
# aux 0: see the module docstring; z as the MoE contract's build (large enough to move the step)
ROUTER_COEFS = {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.05}


def lora_section(adapter: str | Path) -> dict[str, Any]:
    """The ``model.lora`` section of the MoE runs (a plain dict, as a user writes it)."""
    return {
        "rank": RANK,
        "alpha": ALPHA,
        "target_modules": TARGETS,
        "target_experts": True,
        "path": str(adapter),
    }


def expert_name(layer: int, expert: int, proj: str, which: str) -> str:
    """The per-expert PEFT name of one expert adapter matrix."""
    return f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}.{which}.weight"


class LoraExperts(torch.nn.Module):
    """transformers' eager Qwen3-MoE experts (``base``, frozen) with a LoRA adapter on each
    expert's gate, up and down projection: ``lora_A[p][e]`` ``[r, in]``, ``lora_B[p][e]``
    ``[out, r]`` (stacked over experts; every use indexes one expert). Zero at the start, or
    ``0.3 * randn`` from ``gen`` (a non-zero adapter whose gradients reach A and B)."""

    def __init__(
        self, base: torch.nn.Module, scale: float, gen: torch.Generator | None = None
    ) -> None:
        super().__init__()
        self.base, self.scale = base, scale
        experts, two_f, hidden = base.gate_up_proj.shape
        f = two_f // 2
        shapes = {"gate_proj": (hidden, f), "up_proj": (hidden, f), "down_proj": (f, hidden)}
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        for p, (fan_in, fan_out) in shapes.items():
            for which, shape in (
                ("lora_A", (experts, RANK, fan_in)),
                ("lora_B", (experts, fan_out, RANK)),
            ):
                init = (
                    torch.zeros(shape) if gen is None else 0.3 * torch.randn(shape, generator=gen)
                )
                getattr(self, which)[p] = torch.nn.Parameter(init.to(F32))

    def _proj(self, x: torch.Tensor, weight: torch.Tensor, p: str, e: int) -> torch.Tensor:
        out = torch.nn.functional.linear(x, weight)
        return out + self.scale * (x @ self.lora_A[p][e].t()) @ self.lora_B[p][e].t()

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.base.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            x = hidden_states[token]
            gate_w, up_w = self.base.gate_up_proj[e].chunk(2)
            h = self.base.act_fn(self._proj(x, gate_w, "gate_proj", e))
            h = h * self._proj(x, up_w, "up_proj", e)
            y = self._proj(h, self.base.down_proj[e], "down_proj", e)
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out

    def tensors(self, layer: int, of: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        """Each expert's A and B (``of``: the parameter or its gradient) in PEFT names."""
        out = {}
        for p in EXPERT_PROJECTIONS:
            for which in ("lora_A", "lora_B"):
                for e, t in enumerate(of(getattr(self, which)[p])):
                    out[expert_name(layer, e, p, which)] = t.detach().to(F32).clone()
        return out

    @torch.no_grad()
    def load(self, layer: int, tensors: Mapping[str, torch.Tensor]) -> None:
        for p in EXPERT_PROJECTIONS:
            for which in ("lora_A", "lora_B"):
                stack = getattr(self, which)[p]
                for e in range(stack.shape[0]):
                    stack[e].copy_(tensors[expert_name(layer, e, p, which)])


def _layers(model: Any) -> Any:
    return model.base_model.model.model.layers


def _attention_peft(model_dir: str | Path) -> Any:
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION_TARGETS)
    return peft.get_peft_model(load_model(model_dir), config)


def adapter_state(model: Any, of: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    """The whole adapter (``of``: values or gradients) in PEFT names: peft's attention adapters
    (its parameter names without the adapter name) and every expert's."""
    state = {
        n.replace(".default", ""): of(p).detach().to(F32).clone()
        for n, p in model.named_parameters()
        if "lora_" in n and ".mlp.experts." not in n
    }
    for i, layer in enumerate(_layers(model)):
        state |= layer.mlp.experts.tensors(i, of)
    return dict(sorted(state.items()))


def write_start_adapter(model_dir: str | Path, out: Path) -> Path:
    """A PEFT folder with seeded random A and B (as the dense contract's): peft's
    ``save_pretrained`` of the attention adapters, the expert adapters added in per-expert names
    and the expert projections added to the config's targets (what Megatron exports)."""
    from safetensors.torch import load_file, save_file

    model = _attention_peft(model_dir)
    for layer in _layers(model):
        layer.mlp.experts = LoraExperts(layer.mlp.experts, ALPHA / RANK)
    g = torch.Generator().manual_seed(ADAPTER_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * ADAPTER_STD)
    state = adapter_state(model, lambda p: p)
    for layer in _layers(model):  # peft saves its own (attention) adapters only
        layer.mlp.experts = layer.mlp.experts.base
    model.save_pretrained(out)
    weights = out / "adapter_model.safetensors"
    saved = load_file(str(weights))
    assert set(saved) <= set(state), sorted(set(saved) - set(state))
    save_file(state, str(weights), metadata={"format": "pt"})
    config = json.loads((out / "adapter_config.json").read_text())
    config["target_modules"] = TARGETS
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def load_adapted(model_dir: str | Path, adapter: str | Path) -> Any:
    """The base with peft's attention adapters and `LoraExperts` on every layer, both loaded
    from ``adapter`` (each tensor by its PEFT name; every one is used)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    model = _attention_peft(model_dir)
    for i, layer in enumerate(_layers(model)):
        layer.mlp.experts = LoraExperts(layer.mlp.experts, ALPHA / RANK)
        layer.mlp.experts.load(i, tensors)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n and ".mlp.experts." not in n:
                p.copy_(tensors[n.replace(".default", "")])
    assert sorted(tensors) == sorted(adapter_state(model, lambda p: p))
    return model


class ExpertLoraReference(LoraReference):
    """`LoraReference` on the MoE fixture: the policy of `load_adapted`, the adapter in
    per-expert names, and the router's z-loss in the step (`ROUTER_COEFS`)."""

    def load(self, model_dir: str | Path, adapter: str | Path) -> Any:
        return load_adapted(model_dir, adapter)

    def router_term(self, records: list[Mapping[str, Any]]) -> tuple[torch.Tensor, dict] | None:
        # z is a mean over tokens weighted by tokens: one microbatch of every sample gives the
        # term of any split (the load-balancing term, which would not, has coefficient 0)
        assert self.s.router_aux_coef == 0.0, "the LoRA contract's MoE step has no aux term"
        term, metrics = moe_reference.router_term(
            self.model, records, [list(range(len(records)))], aux_coef=0.0,
            z_coef=self.s.router_z_coef,
        )  # fmt: skip
        return term, {"router/z_loss": metrics["router/z_loss"]}

    def state(self, of: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        return adapter_state(self.model, of)
