"""Loading the DeepSpeed backend's Hugging Face model: from a saved folder, from a config dict with
a seed, in bf16, and the errors for a wrong path or config. No DeepSpeed engine is built here."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.tiny_models import MICRO_LLAMA  # noqa: E402
from unirl.backends.causal_lm import (  # noqa: E402
    build_from_config,
    load_policy,
    load_reference,
)
from unirl.core.config.run_config import ModelConfig  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402

HF_CONFIG = dict(MICRO_LLAMA)


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny llama saved with plain transformers, and its weights."""
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**HF_CONFIG)
    )
    model.save_pretrained(folder)
    return folder, _state(model)


def test_load_from_saved_folder(saved):
    folder, weights = saved
    model = load_policy(ModelConfig(path=str(folder)))
    got = _state(model)
    assert got.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(got[name], value), name
    assert model.training and model.config.use_cache is False
    assert not model.is_gradient_checkpointing
    assert load_policy(
        ModelConfig(path=str(folder), gradient_checkpointing=True)
    ).is_gradient_checkpointing


def test_config_dict_with_seed_is_deterministic():
    rng_before = torch.get_rng_state()
    a = _state(build_from_config(HF_CONFIG, seed=5, dtype=torch.float32))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's stream did not move
    b = _state(load_policy(ModelConfig(hf_config=HF_CONFIG, init_seed=5)))
    c = _state(build_from_config(HF_CONFIG, seed=6, dtype=torch.float32))
    assert all(torch.equal(a[k], b[k]) for k in a)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a[weight], c[weight])


def test_bf16_is_the_fp32_init_rounded():
    fp32 = _state(build_from_config(HF_CONFIG, seed=1, dtype=torch.float32))
    bf16 = load_policy(ModelConfig(hf_config=HF_CONFIG, init_seed=1, dtype="bf16"))
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    for name, value in _state(bf16).items():
        assert torch.equal(value, fp32[name].to(torch.bfloat16)), name


def test_reference_is_frozen_initial_weights(saved, tmp_path):
    folder, weights = saved
    ref = load_reference(ModelConfig(path=str(folder)))
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(_state(ref)[k], v) for k, v in weights.items())
    seeded = load_reference(ModelConfig(hf_config=HF_CONFIG, init_seed=5))
    expected = build_from_config(HF_CONFIG, seed=5, dtype=torch.float32)
    assert all(torch.equal(_state(seeded)[k], v) for k, v in _state(expected).items())
    with pytest.raises(ConfigError, match=r"model\.ref_path='.*nowhere' does not exist"):
        load_reference(ModelConfig(path=str(folder), ref_path=str(tmp_path / "nowhere")))


def test_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.path='.*missing' does not exist"):
        load_policy(ModelConfig(path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"model\.path='.*empty' has no config\.json"):
        load_policy(ModelConfig(path=str(tmp_path / "empty")))
    no_type = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    with pytest.raises(ConfigError, match=r"model\.hf_config=.* has no model_type"):
        load_policy(ModelConfig(hf_config=no_type))
    with pytest.raises(ConfigError, match=r"model\.hf_config\.model_type='no_such_model'"):
        load_policy(ModelConfig(hf_config={**HF_CONFIG, "model_type": "no_such_model"}))
