"""The old-log-prob decision's extension point: a feature that lives outside unirl (here, in the
test suite) registers its need with `register_need`, and `unirl check` then recomputes the old
log-probs and prints the feature's reason, with no edit under ``unirl/core``."""

from __future__ import annotations

import pytest
import yaml

from unirl.cli import main
from unirl.core import old_logprobs
from unirl.core.config.run_config import UnirlConfig, config_from_dict
from unirl.core.old_logprobs import RolloutShape, decide_old_logprobs, register_need

CONFIG = {
    "model": {"hf_config": {"model_type": "llama", "vocab_size": 16}},
    "batch": {
        "prompts_per_rollout": 4,
        "samples_per_prompt": 2,
        "samples_per_optimizer_step": 8,  # one optimizer step: nothing built in needs old log-probs
        "micro_batch_size": 4,
    },
    "parallel": {"world_size": 1},
    "rollout": {"max_new_tokens": 8, "temperature": 0.7},
}
REASON = "a plug-in's sample filter scores every sample with the policy's log-probs at T=0.7"


@pytest.fixture
def own_needs(monkeypatch):
    """A copy of the registry for this test: the registration does not outlive it."""
    monkeypatch.setattr(old_logprobs, "_NEEDS", dict(old_logprobs._NEEDS))


def register_filter_need() -> None:
    @register_need("plugin_sample_filter")
    def _filter(cfg: UnirlConfig, shape: RolloutShape) -> str | None:
        # active only for sampled rollouts below temperature 1 (what the plug-in filters)
        return REASON if cfg.rollout.temperature < 1.0 else None


def test_a_need_registered_outside_core_changes_the_decision(own_needs, tmp_path, capsys):
    cfg = config_from_dict(CONFIG)
    assert decide_old_logprobs(cfg).source == "reuse"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    assert main(["check", str(path)]) == 0
    before = capsys.readouterr().out
    assert (
        "old log-probs: reuse (requested: auto)" in before and "plugin_sample_filter" not in before
    )

    register_filter_need()
    decision = decide_old_logprobs(cfg)
    assert decision.source == "recompute"
    assert [(n.feature, n.reason) for n in decision.needs] == [("plugin_sample_filter", REASON)]
    assert main(["check", str(path)]) == 0
    after = capsys.readouterr().out
    assert "old log-probs: recompute (requested: auto)" in after
    assert f"  - plugin_sample_filter: {REASON}" in after
    # the need reads the config: at temperature 1 it is inactive and reuse is back
    hot = config_from_dict({**CONFIG, "rollout": {"max_new_tokens": 8, "temperature": 1.0}})
    assert decide_old_logprobs(hot).source == "reuse"


def test_a_need_cannot_be_registered_twice(own_needs):
    register_filter_need()
    with pytest.raises(ValueError, match=r"plugin_sample_filter.*already registered"):
        register_filter_need()
