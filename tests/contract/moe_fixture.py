"""The contract suite's mixture-of-experts fixture: a tiny Qwen3-MoE, its variants, and the
experts a rollout engine "used" for the routing-replay section.

- Model: the dense fixture's vocabulary, width, heads and init std, 2 layers, both sparse, 8
  experts, top-2 with renormalised weights (``norm_topk_prob``), expert FFN 16 (``etp = 2``
  splits it). The routers are drawn with a larger std (`ROUTER_STD`) than the rest so that each
  token's top-2 is decided by a clear margin: a near tie between the 2nd and 3rd expert would let
  summation order flip a routing decision between a backend and the reference. The regime real
  checkpoints start from (transformers' init, ``initializer_range`` 0.02: near-uniform routing,
  where the load-balancing gradient pulls hard) is `tests.contract.router_init`'s: the same
  shape, every MoE layout, a step whose gradient is the router term's alone.
- Router coefficients (`ROUTER_COEFS`, for the backend the group builds and every variant but
  one): large (aux 0.5, z-loss 0.05), so the router term moves every variant's gradient well above
  the tolerance (at the default aux 0.001 and no z-loss its share of the gradient norm is ~1e-6,
  below it).
- Variants: the policy-loss path once (PPO dual-clip, token-mean, k1 KL, entropy), its microbatch
  split (clause 4), reuse / recompute (clause 5), and the policy-loss path with other router
  coefficients than the build's (`STEP_ROUTER_COEFS`: the step's config is what counts, also on
  Megatron's pipeline stages, which add their layers' router share themselves); the loss the
  backends train on includes the router term, and so does the reference.
- Replay (`REPLAY`): ``routing_replay: rollout`` with `routed_experts` drawn at random (seeded,
  distinct experts per row), so the forced routing differs from the router's own almost
  everywhere and a backend that ignored the given experts fails by far.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.contract import fixtures

ROUTER_STD = 0.5
EXPERTS_SEED = 2468
TINY_QWEN3_MOE = {
    "vocab_size": fixtures.TINY_LLAMA["vocab_size"],
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "attention_dropout": 0.0,
    "router_aux_loss_coef": 0.001,  # what HF's config says; unirl reads algorithm.* only
}
NUM_MOE_LAYERS = TINY_QWEN3_MOE["num_hidden_layers"]
TOP_K = TINY_QWEN3_MOE["num_experts_per_tok"]
NUM_EXPERTS = TINY_QWEN3_MOE["num_experts"]


def write_tiny_moe(path: Path) -> Path:
    """Build the tiny Qwen3-MoE with a fixed seed and `save_pretrained` it (per-expert
    safetensors names, as Qwen3-MoE checkpoints are published)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(fixtures.MODEL_SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_QWEN3_MOE))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, ROUTER_STD)
    model.save_pretrained(path)
    return path


def with_routed_experts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records with ``routed_experts`` ``[prompt + response - 1, layers, top_k]``: per row
    ``top_k`` distinct experts drawn at random (seeded)."""
    g = torch.Generator().manual_seed(EXPERTS_SEED)
    out = []
    for rec in records:
        rows = len(rec["prompt_tokens"]) + len(rec["response_tokens"]) - 1
        draw = torch.rand(rows, NUM_MOE_LAYERS, NUM_EXPERTS, generator=g)
        experts = draw.argsort(dim=-1)[..., :TOP_K]
        out.append({**rec, "routed_experts": experts.tolist()})
    return out


_PPO_DUAL = fixtures.VARIANTS["ppo_dual_k1_token_mean"]["overrides"]
ROUTER_COEFS = {"router_aux_loss_coef": 0.5, "router_z_loss_coef": 0.05}
# What the fixture adds to `fixtures.base_config` (the build's config and every variant's).
BASE = {"algorithm": ROUTER_COEFS}
# One variant's step: coefficients other than the build's (both still large).
STEP_ROUTER_COEFS = {"router_aux_loss_coef": 0.2, "router_z_loss_coef": 0.15}

VARIANTS: dict[str, dict[str, Any]] = {
    "ppo_dual_k1_token_mean": fixtures.VARIANTS["ppo_dual_k1_token_mean"],
    "ppo_dual_mbs1": fixtures.VARIANTS["ppo_dual_mbs1"],
    "reuse": fixtures.VARIANTS["reuse"],
    "recompute": fixtures.VARIANTS["recompute"],
    "ppo_dual_step_router_coefs": {
        "overrides": fixtures.merged(_PPO_DUAL, {"algorithm": STEP_ROUTER_COEFS}),
        "data": fixtures.BOTH,
    },
}

# The replay step: the base variant with the rollout's experts replayed in every forward (R3).
REPLAY = {
    # an engine's experts (the data's): the rollouts of a file, as the sampler records none
    "overrides": fixtures.merged(
        _PPO_DUAL,
        {
            "algorithm": {"routing_replay": "rollout"},
            "rollout": {"source": "file", "file": "r3.jsonl"},
        },
    ),
    "data": (*fixtures.BOTH, "routed_experts"),
}
