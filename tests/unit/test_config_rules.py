"""The registry of config rules owned outside core (`unirl.core.config.rules`): the rollouts
package registers the rules of its keys, and a built config runs them."""

import inspect

import pytest

import unirl.core.config.run_config as run_config
from unirl.core.config.rules import CONFIG_RULES
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError
from unirl.rollouts.data.rules import check_prompts, check_stops
from unirl.rollouts.environments.rules import check_environment
from unirl.rollouts.eval.rules import check_eval

BASE = {
    "backend": "deepspeed",
    "model": {"hf_config": {"model_type": "llama", "num_hidden_layers": 2, "vocab_size": 32}},
    "batch": {
        "prompts_per_rollout": 2,
        "samples_per_prompt": 2,
        "samples_per_optimizer_step": 4,
        "micro_batch_size": 2,
    },
    "parallel": {"world_size": 1},
}


def test_rollouts_register_the_rules_of_their_keys_in_order():
    # prompts before stops before environment before eval: the order core ran them in.
    assert CONFIG_RULES.in_order()[:4] == [
        check_prompts,
        check_stops,
        check_environment,
        check_eval,
    ]


def test_core_keeps_no_rule_of_a_rollout_key():
    source = inspect.getsource(run_config)
    for name in ("_check_prompts", "_check_stops", "_check_environment", "_check_eval"):
        assert name not in source


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"reward": "math_answer"}, "rollout.reward='math_answer' applies to prompts read from"),
        ({"stop": [""]}, "rollout.stop[0] is empty"),
        ({"max_turns": 3}, "rollout.max_turns=3 applies to multi-turn episodes"),
    ],
)
def test_a_built_config_runs_the_registered_rules(rollout, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict({**BASE, "rollout": rollout})


def test_a_registered_rule_runs_at_config_build_and_leaves_with_its_scope():
    seen = []

    def rule(cfg):
        seen.append(cfg.rollout.source)
        raise ConfigError("toy rule: refused")

    with CONFIG_RULES.scoped():
        CONFIG_RULES.register("toy", rule)
        with pytest.raises(ConfigError, match="toy rule: refused"):
            config_from_dict(BASE)
    assert seen == ["sampler"]
    config_from_dict(BASE)  # the rule is gone with its scope
