"""``model.liger_kernels`` (`unirl.backends.hf.liger`): refused where it cannot run, saying what
to change; on a CUDA GPU the patched model's log-probs and gradients equal eager transformers'
(fp32, the same weights).

    PYTHONPATH=$PWD python -m pytest -q tests/unit/test_liger_kernels.py          # CPU refusals
    PYTHONPATH=$PWD python -m pytest -q -m gpu tests/unit/test_liger_kernels.py   # on a GPU
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util

import pytest
import torch

from unirl.core.errors import ConfigError

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None

TINY = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def tiny_model(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def test_refused_off_the_gpu():
    from unirl.backends.hf.liger import apply_liger_kernels

    with pytest.raises(ConfigError, match=r"needs a CUDA GPU.*set model.liger_kernels: false"):
        apply_liger_kernels(tiny_model("qwen2"), "cpu")


def test_refused_for_other_model_types():
    from unirl.backends.hf.liger import apply_liger_kernels

    with pytest.raises(ConfigError, match=r"model types llama, mistral, qwen2, qwen3.*'gpt2'"):
        apply_liger_kernels(
            type("M", (), {"config": type("C", (), {"model_type": "gpt2"})})(), "cuda"
        )


@pytest.mark.parametrize("fields", [{"hidden_act": "gelu"}, {"mlp_bias": True}])
def test_refused_for_an_mlp_liger_would_change(fields):
    """Liger's SwiGLU MLP is SiLU without biases: any other MLP would be silently replaced."""
    from transformers import AutoConfig

    from unirl.backends.hf.liger import apply_liger_kernels

    model = type("M", (), {"config": AutoConfig.for_model("llama", **TINY, **fields)})()
    with pytest.raises(
        ConfigError, match=r"Liger's SwiGLU \(SiLU, no bias\).*liger_kernels: false"
    ):
        apply_liger_kernels(model, "cuda")


def test_megatron_refuses_the_key():
    from unirl.core.config.run_config import config_from_dict

    with pytest.raises(ConfigError, match=r"model.liger_kernels: true is for the Hugging Face"):
        config_from_dict(
            {
                "backend": "megatron",
                "model": {"hf_config": {"model_type": "llama", **TINY}, "liger_kernels": True},
            }
        )


def test_off_by_default():
    from unirl.core.config.sections.model import ModelConfig

    assert ModelConfig().liger_kernels is False


@contextlib.contextmanager
def restored_module(model_type: str):
    """Liger patches transformers' modeling module of the type (rotary function, classes):
    undo it after the test so no later test runs on Liger's kernels."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    saved = dict(vars(module))
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(module, key, value)


def logprobs_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    logp.sum().backward()
    return logp.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Liger is Triton)")
@pytest.mark.skipif(not HAS_LIGER, reason="needs the liger-kernel package")
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_same_logprobs_and_gradients_as_eager(model_type):
    from unirl.backends.hf.liger import apply_liger_kernels

    eager = tiny_model(model_type).cuda()
    ids = torch.randint(0, TINY["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    ref_logp, ref_grads = logprobs_and_grads(eager, ids)
    with restored_module(model_type):
        patched = copy.deepcopy(eager)
        apply_liger_kernels(patched, "cuda")
        names = {type(m).__name__ for m in patched.modules()}
        assert any("Liger" in n for n in names) or any(
            "Liger" in getattr(m.forward, "__qualname__", "") for m in patched.modules()
        ), "no module was patched"
        logp, grads = logprobs_and_grads(patched, ids)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=2e-5)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
