"""The router's auxiliary losses on the Megatron backend against Hugging Face fp32.

A tiny Qwen3-MoE (2 sparse layers, 8 experts, top-2) built by the backend from
``model.hf_config`` + ``init_seed``; two packed microbatches (sequences of 5 and 7 tokens, then
4) through `forward_backward` (megatron's schedule, gloo), the loss a weighted sum of the
log-probs plus core's router term (`unirl.core.moe_loss.router_term`, large coefficients so the
router term dominates its weights' gradients), with the router logits the backend hands the loss.
The reference, written here: the HF model with the backend's weights runs each sequence alone;
``aux`` of a microbatch is transformers' own ``load_balancing_loss_func`` over the rows of its
sequences, ``z`` the mean of ``logsumexp(logits)^2`` over the same rows; the step's router term
the token-weighted sum; gradients by autograd. Compared: the metrics ``router/aux_loss`` /
``router/z_loss`` and the gradient of every non-expert weight (routers, attention, norms,
embedding, head) and of the experts, on EP1 with ``megatron.attention`` packed and padded.
"""

import importlib.util
import itertools

import pytest
import torch

from tests.contract.moe_reference import per_expert
from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

HF_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 24,
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
}
AUX_COEF, Z_COEF = 0.7, 0.05
LENGTHS = ([5, 7], [4])


def _microbatch(lengths, seed, vocab=HF_CONFIG["vocab_size"], routed_experts=None):
    from unirl.core.data.microbatch import TrainMicrobatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    targets = tokens.clone()
    for start, n in zip(cu[:-1].tolist(), lengths):
        targets[start : start + n - 1] = tokens[start + 1 : start + n]
        targets[start + n - 1] = 0
    mask = torch.ones(sum(lengths))
    mask[(cu[1:] - 1).tolist()] = 0.0
    return TrainMicrobatch(
        sample_indices=tuple(range(len(lengths))),
        tokens=tokens,
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
        cu_seqlens=cu.to(torch.int32),
        targets=targets,
        loss_mask=mask,
        seq_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
        seq_token_counts=torch.tensor([n - 1 for n in lengths]),
        routed_experts=routed_experts,
    )


def _weights(n):
    return torch.linspace(-1.0, 1.0, n)


def _config(attention, pp):
    return {
        "backend": "megatron",
        "model": {"hf_config": dict(HF_CONFIG), "init_seed": 3, "max_seq_len": 16},
        "optimizer": {"lr": 1e-3},
        "batch": dict(TINY_BATCH),
        "algorithm": {"router_aux_loss_coef": AUX_COEF, "router_z_loss_coef": Z_COEF},
        "megatron": {"attention": attention},
        "parallel": {"pp": pp},
        "train": {"seed": 0},
        "logging": {"tensorboard": False},
    }


def _worker(rank, world_size, attention, pp):
    from unirl.backends.megatron import build_backend
    from unirl.core.config.model_shape import moe_shape
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.moe_loss import LossWithRouterTerm, RouterLossSettings
    from unirl.core.progress.bars import MicrobatchProgress

    cfg = config_from_dict(_config(attention, pp), world_size=world_size)
    backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
    weights = backend.hf_state_dict()
    settings = RouterLossSettings.from_config(cfg, moe_shape(cfg.model))
    mbs = [_microbatch(lengths, seed=i) for i, lengths in enumerate(LENGTHS)]
    global_tokens = sum(mb.num_tokens for mb in mbs)

    def policy(mb, logprobs, entropy):
        return (_weights(mb.num_tokens) * mb.loss_mask * logprobs).sum(), {}

    # pp = 1: the backend hands the router logits to the loss, which adds the term; pp > 1: each
    # stage backpropagates its layers' share with the loss's settings
    loss_fn = LossWithRouterTerm(policy=policy, router=settings, global_tokens=global_tokens)

    spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size)
    with MicrobatchProgress("test", len(mbs), backend.topology, enabled=False) as bar:
        metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
    chunks = backend.model
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.copy_(param.main_grad)
    grads = backend.hf_state_dict()
    backend.close()
    return {"weights": weights, "grads": grads, "metrics": metrics}


def _reference(weights):
    """The HF fp32 model with ``weights``: per microbatch the router term's inputs and the
    loss, and the gradients (per-expert names) of the whole step's loss."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model("qwen3_moe", **fields)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    model.load_state_dict(_per_expert_to_hf(weights, model), strict=True)
    mbs = [_microbatch(lengths, seed=i) for i, lengths in enumerate(LENGTHS)]
    global_tokens = sum(mb.num_tokens for mb in mbs)
    total, values = 0.0, []
    for mb in mbs:
        logps, layer_rows = [], None
        for start, end in itertools.pairwise(mb.cu_seqlens.tolist()):
            out = model(mb.tokens[start:end][None], output_router_logits=True)
            logp = torch.log_softmax(out.logits[0], -1).gather(1, mb.targets[start:end, None])
            logps.append(logp[:, 0])
            rows = [r.reshape(-1, HF_CONFIG["num_experts"]) for r in out.router_logits]
            layer_rows = (
                rows if layer_rows is None else [torch.cat(p) for p in zip(layer_rows, rows)]
            )
        lp = (_weights(mb.num_tokens) * mb.loss_mask * torch.cat(logps)).sum()
        aux = load_balancing_loss_func(
            tuple(layer_rows), HF_CONFIG["num_experts"], HF_CONFIG["num_experts_per_tok"]
        )
        z = torch.logsumexp(torch.cat(layer_rows), -1).square().mean()
        values.append((aux.item(), z.item()))
        total = total + lp + (AUX_COEF * aux + Z_COEF * z) * mb.num_tokens / global_tokens
    total.backward()
    grads = per_expert({n: p.grad for n, p in model.named_parameters()})
    return values, grads


def _per_expert_to_hf(weights, model, experts=HF_CONFIG["num_experts"]):
    """The exported per-expert state dict in the (fused) names of this transformers' model."""
    names = {k: v for k, v in model.state_dict().items()}
    split = per_expert(names)
    if set(split) == set(names):
        return weights
    out = {}
    for name in names:
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            out[name] = torch.stack(
                [
                    torch.cat(
                        [
                            weights[f"{prefix}{e}.gate_proj.weight"],
                            weights[f"{prefix}{e}.up_proj.weight"],
                        ]
                    )
                    for e in range(experts)
                ]
            )
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            out[name] = torch.stack(
                [weights[f"{prefix}{e}.down_proj.weight"] for e in range(experts)]
            )
        else:
            out[name] = weights[name]
    return out


@pytest.mark.parametrize(
    ("attention", "pp"),
    [
        pytest.param("packed", 1, id="ep1"),
        # the slow tier (tests/conftest.py): about 35 s and 110 s on two cores
        pytest.param("padded", 1, id="padded", marks=pytest.mark.slow),
        pytest.param("packed", 2, id="pp2", marks=pytest.mark.slow),
    ],
)
def test_router_losses_match_hugging_face(attention, pp):
    results = run_distributed(_worker, pp, attention, pp)
    (result,) = [r for r in results if r["metrics"]]  # the last stage's
    for other in results:  # every stage's gradients, gathered by the export
        torch.testing.assert_close(other["grads"], result["grads"])
    values, ref_grads = _reference(result["weights"])
    for mb_metrics, lengths, (aux, z) in zip(result["metrics"], LENGTHS, values):
        n = sum(lengths)
        got_aux = mb_metrics["router/aux_loss"]
        got_z = mb_metrics["router/z_loss"]
        assert got_aux.denominator == n and got_z.denominator == n
        assert float(got_aux.numerator) / n == pytest.approx(aux, rel=1e-5)
        assert float(got_z.numerator) / n == pytest.approx(z, rel=1e-5)
    assert set(result["grads"]) == set(ref_grads)
    router_seen = 0
    for name, grad in ref_grads.items():
        torch.testing.assert_close(result["grads"][name], grad, atol=1e-5, rtol=1e-4)
        router_seen += "mlp.gate.weight" in name
    assert router_seen == HF_CONFIG["num_hidden_layers"]


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"parallel": {"pp": 2, "cp": 2}}, r"parallel\.pp=2 and parallel\.cp=2"),
        ({"model": {"gradient_checkpointing": True}}, r"gradient_checkpointing: true"),
        (
            {
                "model": {"gradient_checkpointing": True},
                "algorithm": {
                    "router_aux_loss_coef": 0.0,
                    "router_z_loss_coef": 0.0,
                    "routing_replay": "rollout",
                },
                "rollout": {"source": "file", "file": "r3.jsonl"},
            },
            r"routing_replay='rollout' with model\.gradient_checkpointing",
        ),
    ],
    ids=["pp-cp", "recompute", "replay-recompute"],
)
def test_megatron_refuses_what_it_cannot_route(changes, pattern):
    """The plug-in's check, before any process starts: router losses under pp x cp or full
    recompute, routing replay under full recompute."""
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.errors import ConfigError

    data = _config("packed", 1)
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    world = data["parallel"].get("pp", 1) * data["parallel"].get("cp", 1)
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(data, world_size=world)
