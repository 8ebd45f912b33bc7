"""A rollout source registered from the test suite (`tests.plugins.toy_source`) runs `unirl check`
and `unirl train`: adding a source needs no edit under ``unirl/core``, ``cli.py`` or
``log_setup.py``. With ``lag: 1`` it hands out rollouts of the weights one sync old, and the run
records which version each rollout came from and how stale it was."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import yaml

from tests.plugins import toy_backend, toy_source
from tests.unit.test_terminal_output import restore_logging  # noqa: F401  (a fixture)
from unirl import log_setup
from unirl.backends import BACKENDS
from unirl.cli import main
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import SOURCES
from unirl.core.run.metrics_log import read_metrics
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import build_rollout_source

VOCAB = 16  # reverse_digits' character tokenizer has 14 ids


@pytest.fixture
def toys_registered():
    BACKENDS.register("toy", toy_backend.PLUGIN)
    SOURCES.register("toy", toy_source.PLUGIN)
    yield
    BACKENDS.unregister("toy")
    SOURCES.unregister("toy")


def config_data(tmp_path, **rollout) -> dict:
    return toy_backend.config_data(
        VOCAB,
        rollout={
            "source": "toy",
            "toy": {"response_length": 4, "lag": 1},
            "task": "reverse_digits",
            "task_options": {"min_digits": 2, "max_digits": 3},
            "max_new_tokens": 5,
            **rollout,
        },
        train={"rl_steps": 3},
        logging={"run_dir": str(tmp_path / "run"), "tensorboard": False},
        checkpoint={"export_hf": False},
    )


def write(tmp_path, data) -> str:
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_unknown_source_lists_the_registered_ones(tmp_path):
    with pytest.raises(
        ConfigError, match=r"rollout.source='toy' is not a registered rollout source"
    ):
        config_from_dict(config_data(tmp_path) | {"backend": "deepspeed", "toy": None})


def test_check_prints_the_sources_section_and_description(toys_registered, tmp_path, capsys):
    path = write(tmp_path, config_data(tmp_path))
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out.split("# resolved config")[1].split("\n", 1)[1])
    assert resolved["rollout"]["toy"] == {"response_length": 4, "lag": 1}
    rollouts = out.split("# rollouts")[1].split("# old-log-prob")[0]
    assert "source: toy" in rollouts
    assert "engine: toy: 4 tokens per response from a ToyLM in this process" in rollouts
    assert "policy_version: the weights of 1 sync(s) before the last" in rollouts


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.toy.lagg=1", "unknown key 'rollout.toy.lagg' (did you mean 'lag'?)"),
        ("rollout.toy.lag=-1", "rollout.toy.lag"),
        ("rollout.toy.response_length=6", "rollout.toy.response_length=6 exceeds"),
        ("rollout.vllm.kv_cache_gb=1", "section 'rollout.vllm:' configures rollout source vllm"),
    ],
)
def test_check_applies_the_sources_own_rules(toys_registered, tmp_path, capsys, override, message):
    path = write(tmp_path, config_data(tmp_path))
    assert main(["check", path, "--set", override]) == 2
    assert message in capsys.readouterr().err


def test_train_on_the_toy_source_records_each_rollouts_version(toys_registered, tmp_path):
    """Three RL steps of one optimizer step each, the source one sync behind: the rollouts come
    from versions 0, 0, 1 (the initial weights twice, then those after step 1) while the trainer
    trains versions 0, 1, 2: staleness 0, 1, 1."""
    assert main(["train", write(tmp_path, config_data(tmp_path))]) == 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["optimizer_steps"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r["rollout/policy_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    # algorithm.decoupled: auto, decided per rollout: off on-policy, on for the stale ones
    assert ["decoupled_weight_mean" in r for r in rows] == [False, True, True]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)


def test_lagging_source_generates_from_the_older_weights(toys_registered, tmp_path):
    """The samples' log-probs are those of the weights their version names, computed here by
    hand (embedding -> tanh -> output layer, at the rollout temperature)."""
    cfg = config_from_dict(config_data(tmp_path, temperature=0.7))
    source = build_rollout_source(cfg)
    old, new = (toy_backend.ToyLM(VOCAB, 8) for _ in range(2))
    source.sync_weights(as_buckets(old.state_dict()), policy_version=4)
    source.sync_weights(as_buckets(new.state_dict()), policy_version=5)
    batch = source.next_rollout(0)
    for s in batch.samples:
        assert s.policy_version == 4
        tokens = torch.cat([s.prompt_tokens, s.response_tokens])
        with torch.no_grad():
            logits = old(tokens[:-1])[s.prompt_length - 1 :] / 0.7
            ref = torch.log_softmax(logits, -1).gather(1, s.response_tokens[:, None])[:, 0]
        torch.testing.assert_close(s.rollout_logprobs, ref, atol=1e-6, rtol=0)


@pytest.mark.usefixtures("restore_logging")
def test_the_sources_engine_logs_follow_logging_level(toys_registered, monkeypatch):
    """The logger and the environment variable the plug-in declares, with no edit of
    `unirl.log_setup`."""
    monkeypatch.delenv(toy_source.LOG_LEVEL_ENV, raising=False)
    engine = logging.getLogger(toy_source.LOGGER)
    log_setup.apply_log_level("INFO")
    assert not engine.isEnabledFor(logging.WARNING) and engine.isEnabledFor(logging.ERROR)
    assert os.environ[toy_source.LOG_LEVEL_ENV] == "ERROR"
    log_setup.apply_log_level("DEBUG")
    assert engine.isEnabledFor(logging.DEBUG)
    assert os.environ[toy_source.LOG_LEVEL_ENV] == "DEBUG"
