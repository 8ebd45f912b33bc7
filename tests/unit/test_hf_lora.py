"""``model.lora`` on the DeepSpeed and FSDP2 backends in one process, against transformers + peft
in fp32 written here: the policy's and the reference's log-probs, one optimizer step (gradient norm
over the adapter, the updated adapter, the base bit for bit unchanged), the adapter in PEFT names,
its export reloaded with ``peft.PeftModel.from_pretrained``, the merged weights
``W + scale * B @ A``, and a target the model lacks refused before anything is built.

The adapter starts from a random PEFT folder written here (B non-zero), so A's gradients are not
trivially zero."""

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
    make_sequences,
    num_response_tokens,
    pack,
    reference_logprobs,
    reference_loss,
    save_tiny_model,
    train_step,
)
from unirl.core.config.sections.lora import LoraConfig  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8.0


def random_adapter(base: Path, out: Path) -> Path:
    """A PEFT folder with random A and B (peft's own save), the run's starting adapter."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS))
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    wrapped.save_pretrained(out)
    return out


def peft_model(base: Path, adapter: Path, *, trainable: bool = False):
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=trainable)


def reference_step(base: Path, adapter: Path, seqs, *, lr: float, clip: float, wd: float):
    """The step in plain peft fp32 on the full batch: (grad norm, {PEFT name: new tensor})."""
    model = peft_model(base, adapter, trainable=True)
    reference_loss(model, seqs).backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    torch.nn.utils.clip_grad_norm_(params, clip)
    torch.optim.AdamW(params, lr=lr, weight_decay=wd).step()
    return norm, peft.get_peft_model_state_dict(model)


def lora_config(folder: Path, adapter: Path | None, backend: str, stage: int = 0, **lora):
    from unirl.backends.fsdp2.plugin import Fsdp2Options

    section = LoraConfig(
        rank=RANK,
        alpha=ALPHA,
        target_modules=TARGETS,
        path=None if adapter is None else str(adapter),
        **lora,
    )
    extra = {"backend": "fsdp2", "backend_options": Fsdp2Options()} if backend == "fsdp2" else {}
    return make_config(folder, stage=stage, model={"lora": section}, **extra)


def forward(backend, seqs, role):
    with bar(backend, 1) as progress:
        (logp,) = backend.forward_logprobs(
            [pack(seqs)], role=role, spec=LogprobSpec(), progress=progress
        )
    return logp


LAYOUTS = [("deepspeed", 0), ("deepspeed", 3), ("fsdp2", 0)]


@pytest.mark.parametrize(("backend_name", "stage"), LAYOUTS, ids=["zero0", "zero3", "fsdp2"])
def test_lora_step_matches_peft(tiny_folder, tmp_path, backend_name, stage):
    from unirl.backends import build_backend

    adapter = random_adapter(tiny_folder, tmp_path / "start")
    seqs = make_sequences(1)
    cfg = lora_config(tiny_folder, adapter, backend_name, stage)
    backend = build_backend(cfg, total_optimizer_steps=5, needs_reference=True)
    try:
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            want_policy = reference_logprobs(peft_model(tiny_folder, adapter), seqs)
            want_ref = reference_logprobs(base, seqs)
        assert_logprobs_match(forward(backend, seqs, "policy"), want_policy, seqs, atol=1e-5)
        # the reference is the policy with its adapter off: the plain base model's log-probs
        assert_logprobs_match(forward(backend, seqs, "reference"), want_ref, seqs, atol=1e-5)
        assert backend.forward_calls == {"policy": 1, "reference": 1}
        assert backend._reference is None  # no second copy of the weights was loaded

        _, stats = train_step(backend, [pack(seqs[:3]), pack(seqs[3:])], num_response_tokens(seqs))
        norm, want = reference_step(tiny_folder, adapter, seqs, lr=1e-2, clip=0.5, wd=0.1)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-4)
        got = backend.adapter_state_dict()
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=1e-5, rtol=1e-4, msg=name)

        # only the adapter moved: the merged weights are the untouched base + scale * B @ A
        merged = backend.hf_state_dict()
        base_sd = base.state_dict()
        assert sorted(merged) == sorted(base_sd)
        for name, w in base_sd.items():
            module = name.removesuffix(".weight")
            a = got.get(f"base_model.model.{module}.lora_A.weight")
            expected = (
                w
                if a is None
                else w + ALPHA / RANK * got[f"base_model.model.{module}.lora_B.weight"] @ a
            )
            torch.testing.assert_close(merged[name], expected, atol=1e-6, rtol=0, msg=name)
        frozen = {n: p for n, p in base.named_parameters()}
        for name, p in _full_named_params(backend).items():
            if "lora_" not in name:
                clean = name.removeprefix("base_model.model.").replace(".base_layer", "")
                assert torch.equal(p, frozen[clean]), name  # bit for bit

        # the exported adapter reloads with peft and gives the trainer's log-probs
        backend.export_adapter(tmp_path / "out")
        trained = forward(backend, seqs, "policy")
        with torch.no_grad():
            reloaded = reference_logprobs(peft_model(tiny_folder, tmp_path / "out"), seqs)
        assert_logprobs_match(trained, reloaded, seqs, atol=1e-5)
        # the merged Hugging Face folder (on request) is a plain model with those log-probs
        backend.export_hf(tmp_path / "merged")
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
        with torch.no_grad():
            assert_logprobs_match(trained, reference_logprobs(plain, seqs), seqs, atol=1e-5)
    finally:
        backend.close()


def _full_named_params(backend) -> dict[str, torch.Tensor]:
    """The policy's parameters, whole (ZeRO-3 gathered, FSDP2 DTensors made full)."""
    module = backend.model
    if backend.cfg.backend == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
    from tests.hf_reference import full_params

    return full_params(backend)


def test_a_missing_target_is_a_config_error_naming_it(tiny_folder):
    from unirl.backends import build_backend

    cfg = make_config(tiny_folder, model={"lora": LoraConfig(target_modules=("q_proj", "c_attn"))})
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: \['c_attn'\]"):
        build_backend(cfg, total_optimizer_steps=1)
    assert not torch.distributed.is_initialized()  # the process group it started is gone


def _saved_weights(ckpt: Path) -> list[str]:
    """The model tensors a checkpoint holds (DeepSpeed's module files, FSDP2's DCP metadata)."""
    if (ckpt / "dcp").is_dir():
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
        return [k for k in keys if k.startswith("model.")]
    names: list[str] = []
    for f in (ckpt / "state").glob("*model_states.pt"):
        names += list(torch.load(f, weights_only=False)["module"])
    assert names
    return names


def _steps(backend, n: int) -> list:
    out = []
    for step in range(n):
        seqs = make_sequences(20 + step)
        _, stats = train_step(backend, [pack(seqs)], num_response_tokens(seqs))
        out.append((stats.grad_norm, stats.lr))
    return out


# ZeRO-3's LoRA checkpoint is restored in the contract (tests/contract/lora.py, L4 on zero3-dp2).
@pytest.mark.parametrize(
    ("backend_name", "stage"), [LAYOUTS[0], LAYOUTS[2]], ids=["zero0", "fsdp2"]
)
def test_lora_checkpoint_holds_the_adapter_and_resumes_exactly(
    tiny_folder, tmp_path, backend_name, stage
):
    """A from init_seed (B zero); step, save, step; a fresh backend loads and steps the same
    (bit for bit); no frozen weight is in the checkpoint; another base is refused."""
    from unirl.backends import build_backend

    cfg = lora_config(tiny_folder, None, backend_name, stage, init_seed=3)
    first = build_backend(cfg, total_optimizer_steps=5)
    try:
        assert all(
            torch.count_nonzero(v) == 0
            for k, v in first.adapter_state_dict().items()
            if "lora_B" in k
        )
        before = _steps(first, 1)
        first.save_checkpoint(tmp_path / "ckpt", {"step": 1})
        after = _steps(first, 1)
        final = first.adapter_state_dict()
    finally:
        first.close()
    assert all("lora_" in n for n in _saved_weights(tmp_path / "ckpt"))  # no frozen weight

    second = build_backend(cfg, total_optimizer_steps=5)
    try:
        assert second.load_checkpoint(tmp_path / "ckpt") == {"step": 1}
        assert _steps(second, 1) == after and before[0][0] > 0
        for name, value in second.adapter_state_dict().items():
            assert torch.equal(value, final[name]), name
    finally:
        second.close()

    other = save_tiny_model(tmp_path / "other", seed=5)
    third = build_backend(
        lora_config(other, None, backend_name, stage, init_seed=3), total_optimizer_steps=5
    )
    try:
        with pytest.raises(ConfigError, match="adapter trained on other base weights"):
            third.load_checkpoint(tmp_path / "ckpt")
    finally:
        third.close()


def test_convert_merges_an_adapter_only_on_request(tiny_folder, tmp_path):
    """``unirl convert BASE OUT --merge-adapter ADAPTER`` writes base + scale * B @ A (computed
    here); a Megatron layout flag with it, or a non-Hugging Face SOURCE, is refused."""
    from safetensors.torch import load_file

    from unirl.convert import convert

    adapter = random_adapter(tiny_folder, tmp_path / "adapter")
    out = convert(str(tiny_folder), str(tmp_path / "merged"), {}, None, adapter=str(adapter))
    merged = load_file(str(out / "model.safetensors"))
    state = load_file(str(adapter / "adapter_model.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder).state_dict()
    for name, w in base.items():
        module = name.removesuffix(".weight")
        a = state.get(f"base_model.model.{module}.lora_A.weight")
        want = (
            w
            if a is None
            else w + ALPHA / RANK * state[f"base_model.model.{module}.lora_B.weight"] @ a
        )
        if name in merged:
            torch.testing.assert_close(merged[name], want, atol=1e-6, rtol=0, msg=name)
    assert "model.layers.0.self_attn.q_proj.weight" in merged
    with pytest.raises(ConfigError, match="remove the Megatron layout flags"):
        convert(str(tiny_folder), str(tmp_path / "x"), {"tp": 2}, None, adapter=str(adapter))
    with pytest.raises(ConfigError, match="holds no PEFT adapter"):
        convert(str(tiny_folder), str(tmp_path / "y"), {}, None, adapter=str(tmp_path))


def test_check_counts_the_adapter_as_peft_does(tiny_folder, capsys):
    """`unirl check`'s trainable-parameter count equals peft's own count on the same model."""
    from unirl.cli import check_report

    cfg = lora_config(tiny_folder, None, "deepspeed")
    lines = check_report(cfg)["lora"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS))
    trainable, _total = peft.get_peft_model(model, config).get_nb_trainable_parameters()
    assert f"trainable parameters: {trainable:,} in 6 adapted linears" in "\n".join(lines)
    assert any("the policy with its adapter off" in line for line in lines)


def test_target_experts_is_a_config_error_naming_it(tiny_folder):
    from unirl.backends import build_backend

    cfg = make_config(tiny_folder, model={"lora": LoraConfig(target_experts=True)})
    with pytest.raises(ConfigError, match=r"model\.lora\.target_experts: true.*no routed experts"):
        build_backend(cfg, total_optimizer_steps=1)
