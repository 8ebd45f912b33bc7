"""The server's config refuses what it cannot run, naming the key: no API key, a key the SDK
would refuse, unknown keys, the keys the server sets itself."""

from __future__ import annotations

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
