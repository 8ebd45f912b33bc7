"""LoRA with expert adapters (``model.lora.target_experts``) on a tiny Qwen3-MoE under expert
parallel 2 (two ranks: experts 0-3 on rank 0, 4-7 on rank 1; attention data-parallel over both),
against transformers in fp32, with unirl's grouped experts and megatron's SequentialMLP.

The reference is written here: peft adapts the attention's q / k / v / o; transformers 5 holds
the experts as fused ``[E, 2F, H]`` / ``[E, H, F]`` tensors peft cannot adapt per expert, so
`LoraExperts` (a per-expert loop, as transformers' eager experts run) adds each expert's own
``scale * B(A(x))`` to its gate, up and down projections. Its adapter tensors are saved under
the per-expert PEFT names (``mlp.experts.{e}.gate_proj.lora_A.weight``) beside peft's. Compared:
the policy's log-probs, every adapter gradient of one `forward_backward` (both data ranks'
microbatches summed), the gradient norm, one clipped AdamW step, the reference role's log-probs
against the base model's, and the base weights unchanged.
"""

import copy
import importlib.util
import json

import pytest
import torch

from tests.contract.lora_moe_reference import LoraExperts
from tests.distributed.test_megatron_lora import (
    ATOL,
    BETAS,
    CLIP,
    EPS,
    LR,
    _base_params,
    _close,
    _grads,
    _logprobs,
    _weights,
)
from tests.distributed.test_megatron_router_losses import HF_CONFIG, LENGTHS, _microbatch
from tests.spawn import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")
peft = pytest.importorskip("peft", reason="needs peft (unirl[lora])")

RANK, ALPHA = 4, 8.0  # the grouped matmul's fp32 rows: a multiple of 4
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def _hf_config():
    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    return transformers.AutoConfig.for_model("qwen3_moe", **fields)


def _base_model():
    gen = torch.Generator().manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def _adapted(base):
    """peft on the attention, `LoraExperts` on every layer's experts (A, B random; peft 0.21
    would wrap the fused experts tensors itself, as one adapter over all experts)."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=ATTENTION)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    layers = model.base_model.model.model.layers
    for layer in layers:
        layer.mlp.experts = LoraExperts(layer.mlp.experts, ALPHA / RANK, gen=gen)
    return model, layers


def _state(model, layers, of):
    state = {
        n.replace(".default", ""): of(p).detach().clone()
        for n, p in model.named_parameters()
        if "lora_" in n and "experts" not in n
    }
    for i, layer in enumerate(layers):
        state |= layer.mlp.experts.tensors(i, of)
    return state


def _folders(tmp_path):
    from safetensors.torch import load_file, save_file

    base = _base_model()
    base.save_pretrained(tmp_path / "base")
    model, layers = _adapted(base)
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    weights = folder / "adapter_model.safetensors"
    saved = load_file(str(weights))
    saved |= {k: v for k, v in _state(model, layers, lambda p: p).items() if "experts" in k}
    save_file(saved, str(weights))
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = TARGETS  # the experts' projections are adapted too
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(tmp_path / "base"), str(folder), (base, model, layers)


def _microbatches(dp_rank):
    return [_microbatch(lengths, seed=10 * dp_rank + i) for i, lengths in enumerate(LENGTHS)]


def _loss_fn(mb, logprobs, entropy, /, **_):
    return (_weights(mb) * mb.loss_mask * logprobs).sum(), {}


def _worker(rank, world_size, base, adapter, experts):
    from unirl.backends.megatron import build_backend
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress

    lora = {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS, "target_experts": True}
    cfg = config_from_dict(
        {
            "backend": "megatron",
            "model": {
                "path": base,
                "dtype": "fp32",
                "max_seq_len": 16,
                "lora": lora | {"path": adapter},
            },
            "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "grad_clip": CLIP},
            "batch": {
                "prompts_per_rollout": 4,
                "samples_per_prompt": 2,
                "samples_per_optimizer_step": 8,
                "micro_batch_size": 2,
            },
            "algorithm": {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0},
            "parallel": {"ep": 2},
            "megatron": {"experts": experts},
            "train": {"seed": 0},
            "logging": {"tensorboard": False},
        },
        world_size=world_size,
    )
    backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=True)
    topo = backend.topology
    mbs = _microbatches(topo.dp_rank)
    spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size)
    out = {"loaded": backend.adapter_state_dict(), "dp_rank": topo.dp_rank}
    before = _base_params(backend)
    for role in ("policy", "reference"):
        with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
            out[role] = backend.forward_logprobs(mbs, role=role, spec=spec, progress=bar)
    with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
        backend.forward_backward(mbs, loss_fn=_loss_fn, spec=spec, progress=bar)
    out["grads"] = _grads(backend)
    out["grad_norm"] = backend.optimizer_step().grad_norm
    out["stepped"] = backend.adapter_state_dict()
    after = _base_params(backend)
    out["base_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    backend.close()
    return out


@pytest.mark.slow  # the LoRA contract's moe-ep2-grouped and moe-ep2 check all this and more in CI
@pytest.mark.parametrize(
    "experts",
    # grouped: the GPU's default (grouped matmuls, torch's per-expert fallback on the CPU);
    # sequential: the CPU's default (megatron's per-expert linears)
    ["grouped", "sequential"],
)
def test_expert_adapters_under_ep2_match_a_per_expert_reference(tmp_path, experts):
    base_path, adapter, (base, model, layers) = _folders(tmp_path)
    results = run_distributed(_worker, 2, base_path, adapter, experts)
    model.eval()
    want_loaded = _state(model, layers, lambda p: p)
    loss, policy = 0.0, {}
    for dp_rank in range(2):
        policy[dp_rank] = []
        for mb in _microbatches(dp_rank):
            logp = _logprobs(model, mb)
            policy[dp_rank].append(logp.detach())
            loss = loss + (_weights(mb) * mb.loss_mask * logp).sum()
    loss.backward()
    grads = _state(model, layers, lambda p: p.grad)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0).step()
    stepped = _state(model, layers, lambda p: p)
    with torch.no_grad():
        reference = {d: [_logprobs(base, mb) for mb in _microbatches(d)] for d in range(2)}
    for r in results:
        _close(r["loaded"], want_loaded, "loaded adapter")
        _close(r["grads"], grads, "gradients")
        assert r["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
        _close(r["stepped"], stepped, "adapter after one step")
        assert r["base_unchanged"]
        for role, want in (("policy", policy), ("reference", reference)):
            for mb, got, w in zip(_microbatches(r["dp_rank"]), r[role], want[r["dp_rank"]]):
                valid = mb.loss_mask.bool()
                torch.testing.assert_close(got[valid], w[valid], atol=ATOL, rtol=0)
