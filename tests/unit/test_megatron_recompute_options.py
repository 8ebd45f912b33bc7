"""``megatron.recompute_modules`` / ``megatron.recompute_layers``: what each setting asks of
megatron-core's TransformerConfig (`recompute_overrides`), and the settings refused at load with
the key named. The numbers each choice gives are the contract layouts ``recompute-selective`` and
``recompute-block`` (tests/contract)."""

from __future__ import annotations

from pathlib import Path

import pytest

from unirl.backends.megatron.role_model import recompute_overrides
from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_grpo.yaml"


def _cfg(*overrides: str):
    return load_config(TINY, ["backend=megatron", *overrides])


@pytest.mark.parametrize(
    ("overrides", "policy_recompute", "expected"),
    [
        ([], False, {}),
        (
            ["megatron.recompute_modules=[mlp]"],
            False,
            {"recompute_granularity": "selective", "recompute_modules": ["mlp"]},
        ),
        (
            ["model.gradient_checkpointing=true"],
            True,
            {
                "recompute_granularity": "full",
                "recompute_method": "uniform",
                "recompute_num_layers": 1,
            },
        ),
        (
            ["model.gradient_checkpointing=true", "megatron.recompute_layers=1"],
            True,
            {
                "recompute_granularity": "full",
                "recompute_method": "block",
                "recompute_num_layers": 1,
            },
        ),
    ],
)
def test_each_setting_asks_megatron_for_its_recompute(overrides, policy_recompute, expected):
    assert recompute_overrides(_cfg(*overrides), policy_recompute) == expected


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["megatron.recompute_modules=[mlp]", "model.gradient_checkpointing=true"],
            "megatron.recompute_modules=['mlp'] with model.gradient_checkpointing: true",
        ),
        (["megatron.recompute_layers=1"], "megatron.recompute_layers=1 narrows"),
        (
            ["model.gradient_checkpointing=true", "megatron.recompute_layers=3"],
            "between 1 and the layers of one pipeline stage (2)",
        ),
        (["megatron.recompute_modules=[layernorm]"], "megatron.recompute_modules"),
    ],
)
def test_settings_megatron_cannot_take_are_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError, match=None) as err:
        _cfg(*overrides)
    assert words in str(err.value)
