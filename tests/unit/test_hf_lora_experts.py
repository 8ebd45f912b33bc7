"""Expert adapters (``model.lora.target_experts``) on the DeepSpeed and FSDP2 backends, one
process, on a tiny Qwen3-MoE whose experts are fused 3-D tensors: peft's ``target_parameters``
adapts them. The reference is written here with transformers + peft in fp32 (a peft model with
``target_parameters`` loading the same start adapter): the policy's and the reference's
log-probs, one optimizer step (gradient norm over the adapter, the updated adapter), the merged
weights ``W_e + scale * B_e @ A_e`` computed here per expert by a loop, the export reloaded with
``peft.PeftModel.from_pretrained``, and the config errors of a half-named fused projection."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.hf_reference import (  # noqa: E402
    assert_logprobs_match,
    bar,
    make_config,
    make_loss_fn,
    num_response_tokens,
    pack,
    reference_loss,
)
from tests.unit.test_hf_lora import forward  # noqa: E402
from tests.unit.test_hf_moe_backends import moe_folder, sequences  # noqa: E402, F401
from unirl.core.config.sections.algorithm import AlgorithmConfig  # noqa: E402
from unirl.core.config.sections.lora import LoraConfig  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

RANK, ALPHA = 2, 4.0
TARGETS = ("q_proj", "gate_proj", "up_proj", "down_proj")
EXPERT_TENSORS = ["experts.gate_up_proj", "experts.down_proj"]


def _peft_config() -> object:
    return peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS),
                           target_parameters=EXPERT_TENSORS)  # fmt: skip


def random_adapter(base: Path, out: Path) -> Path:
    """A PEFT folder (peft's own save) with random A and B on q_proj and the fused experts."""
    wrapped = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base), _peft_config()
    )
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    wrapped.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path, *, trainable: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        base, attn_implementation="eager", dtype=torch.float32
    )
    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=trainable)


def seq_logprobs(model, seqs) -> list[torch.Tensor]:
    out = []
    for ids, _ in seqs:
        x = torch.tensor(ids)[None]
        logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        out.append(logp[:-1].gather(-1, x[0, 1:, None])[:, 0])
    return out


def reference_step(base: Path, adapter: Path, seqs, *, lr: float, clip: float, wd: float):
    """The step in plain peft fp32 on the whole batch: token-mean NLL minus the entropy bonus."""
    model = peft_model(base, adapter, trainable=True)
    total = reference_loss(model, seqs)
    total.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    torch.nn.utils.clip_grad_norm_(params, clip)
    torch.optim.AdamW(params, lr=lr, weight_decay=wd).step()
    return norm, peft.get_peft_model_state_dict(model)


def train_step(backend, mbs, global_tokens: int):
    """tests.hf_reference's step; a MoE backend also hands the router logits (no router loss
    here: its coefficients are 0)."""
    plain = make_loss_fn(global_tokens)

    def loss_fn(mb, logprobs, entropy, /, *, router_logits=None):
        return plain(mb, logprobs, entropy)

    spec = LogprobSpec(with_entropy=True, entropy_grad=True)
    with bar(backend, len(mbs)) as progress:
        backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=progress)
    return backend.optimizer_step()


def config(folder: Path, adapter: Path | None, backend: str, stage: int = 0, **lora):
    from unirl.backends.fsdp2.plugin import Fsdp2Options

    section = dict(rank=RANK, alpha=ALPHA, target_modules=TARGETS, target_experts=True)
    section.update(lora)
    if adapter is not None:
        section["path"] = str(adapter)
    extra = {"backend": "fsdp2", "backend_options": Fsdp2Options()} if backend == "fsdp2" else {}
    algorithm = AlgorithmConfig(router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    return make_config(folder, model={"lora": LoraConfig(**section)}, algorithm=algorithm, **extra)


def _expert_merged(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``W_e + scale * B_e @ A_e`` per expert, looped: expert e's A rows ``e*r .. e*r + r``,
    its B columns ``e, e + E, ..`` (how peft lays out an adapter on a fused tensor). The scale
    is alpha / rank also where peft doubled both (gate_up: rank 2r, alpha 2 alpha)."""
    experts = w.shape[0]
    rank = a.shape[0] // experts
    out = w.clone()
    for e in range(experts):
        a_e = a[e * rank : (e + 1) * rank]
        b_e = b[:, [r * experts + e for r in range(rank)]]
        out[e] = w[e] + ALPHA / RANK * b_e @ a_e
    return out


@pytest.mark.parametrize(
    ("backend_name", "stage"), [("deepspeed", 0), ("deepspeed", 3), ("fsdp2", 0)],
    ids=["zero0", "zero3", "fsdp2"],
)  # fmt: skip
def test_expert_adapters_match_peft(moe_folder, tmp_path, backend_name, stage):  # noqa: F811
    from unirl.backends import build_backend

    adapter = random_adapter(moe_folder, tmp_path / "start")
    seqs = sequences(1)
    backend = build_backend(
        config(moe_folder, adapter, backend_name, stage=stage),
        total_optimizer_steps=5,
        needs_reference=True,
    )
    try:
        base = transformers.AutoModelForCausalLM.from_pretrained(
            moe_folder, attn_implementation="eager", dtype=torch.float32
        )
        with torch.no_grad():
            want_policy = seq_logprobs(peft_model(moe_folder, adapter), seqs)
            want_ref = seq_logprobs(base, seqs)
        assert_logprobs_match(forward(backend, seqs, "policy"), want_policy, seqs, atol=1e-5)
        # the reference is the policy with its adapter off: the plain base model's log-probs
        assert_logprobs_match(forward(backend, seqs, "reference"), want_ref, seqs, atol=1e-5)

        stats = train_step(backend, [pack(seqs[:2]), pack(seqs[2:])], num_response_tokens(seqs))
        norm, want = reference_step(moe_folder, adapter, seqs, lr=1e-2, clip=0.5, wd=0.1)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-4)
        got = backend.adapter_state_dict()
        assert sorted(got) == sorted(want)
        assert any(".experts.lora_A." in k for k in got)  # the experts are adapted
        for name, tensor in want.items():
            # AdamW's first step is lr * g / (|g| + eps): an expert's gradient near eps (a
            # column few tokens reach) turns a summation-order rounding into up to ~2e-5
            torch.testing.assert_close(
                got[name], tensor, atol=5e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
            )

        merged = backend.hf_state_dict()
        base_sd = base.state_dict()
        assert sorted(merged) == sorted(base_sd)
        prefix = "base_model.model."
        for layer in range(len(base.model.layers)):
            experts = f"model.layers.{layer}.mlp.experts"
            for leaf, wrapper in (("gate_up_proj", ".base_layer"), ("down_proj", "")):
                a = got[f"{prefix}{experts}{wrapper}.lora_A.weight"]
                b = got[f"{prefix}{experts}{wrapper}.lora_B.weight"]
                # gate and up share one tensor: peft gives it rank 2r (one r per projection)
                per_expert = 2 * RANK if leaf == "gate_up_proj" else RANK
                assert a.shape[0] == per_expert * base_sd[f"{experts}.{leaf}"].shape[0]
                want_w = _expert_merged(base_sd[f"{experts}.{leaf}"], a, b)
                torch.testing.assert_close(merged[f"{experts}.{leaf}"], want_w, atol=1e-6, rtol=0)

        backend.export_adapter(tmp_path / "out")
        trained = forward(backend, seqs, "policy")
        with torch.no_grad():
            reloaded = seq_logprobs(peft_model(moe_folder, tmp_path / "out"), seqs)
        assert_logprobs_match(trained, reloaded, seqs, atol=1e-5)
    finally:
        backend.close()


def test_half_a_fused_projection_is_a_config_error(moe_folder):  # noqa: F811
    from unirl.backends import build_backend

    cfg = config(moe_folder, None, "deepspeed", target_modules=("q_proj", "gate_proj"))
    with pytest.raises(ConfigError, match=r"names \['gate_proj'\] but not \['up_proj'\]"):
        build_backend(cfg, total_optimizer_steps=1)


def test_experts_stored_transposed_are_a_config_error():
    """An experts module holding ``[E, in, out]`` (``is_transposed``, as some transformers MoE
    models): the export's per-expert merge assumes ``[E, out, in]``, so it is refused."""
    from unirl.backends.peft_experts import expert_target_parameters
    from unirl.core.config.sections.lora import LoraConfig

    class Experts(torch.nn.Module):
        is_transposed = True

        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 6))
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 3, 8))

    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.experts = Experts()
    lora = LoraConfig(rank=2, target_modules=("gate_proj", "up_proj"), target_experts=True)
    with pytest.raises(ConfigError, match="stored transposed"):
        expert_target_parameters(model, lora)
    Experts.is_transposed = False
    assert expert_target_parameters(model, lora) == ["experts.gate_up_proj"]


@pytest.mark.parametrize(
    ("backend", "count"),
    # examples/tiny_qwen3_moe.yaml, rank 4: hidden 64, expert width 32, 8 experts, 2 layers;
    # attention q 4*(64+64) + k 4*(64+32) + v 4*(64+32) + o 4*(64+64) = 1792 per layer.
    # peft: gate_up rank 8 * 8 experts * (64 + 64) = 8192, down 4 * 8 * (32 + 64) = 3072;
    # Megatron: gate and up 8 * 4 * (64 + 32) each = 6144, down 3072.
    [("deepspeed", 2 * (1792 + 8192 + 3072)), ("megatron", 2 * (1792 + 6144 + 3072))],
)
def test_check_counts_the_expert_adapters(backend, count):
    from unirl.cli import check_report
    from unirl.core.config.run_config import load_config

    example = Path(__file__).parents[2] / "examples" / "tiny_qwen3_moe.yaml"
    over = [f"backend={backend}", "model.lora={rank: 4, alpha: 8, target_experts: true}"]
    lines = check_report(load_config(example, over))["lora"]
    assert f"trainable parameters: {count:,} in 56 adapted linears" in "\n".join(lines)


def test_vllm_refuses_peft_expert_adapters():
    from unirl.core.config.run_config import load_config

    example = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
    with pytest.raises(ConfigError, match=r"target_experts with backend='deepspeed' and rollout"):
        load_config(example, ["model.lora={target_experts: true}"])
