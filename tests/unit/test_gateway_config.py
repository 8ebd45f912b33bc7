"""The ``rollout.agent`` section's rules: each mistake is one `ConfigError` naming the key and the
fix, met when the config is built (so ``unirl check`` and ``unirl train`` agree)."""

from __future__ import annotations

import pytest
import yaml

from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError
from unirl.rollouts.gateway.runner import load_agent


def _example(**agent):
    with open("examples/tiny_agent.yaml") as f:
        data = yaml.safe_load(f)
    data["rollout"]["agent"].update(agent)
    return data


@pytest.mark.parametrize(
    "change, message",
    [
        ({"function": ""}, r"rollout.source: agent needs rollout.agent.function"),
        ({"function": "no_colon"}, r"rollout.agent.function='no_colon'; give the agent function"),
        ({"engine": "vllm", "vllm": {"engines": 32}}, r"rollout.agent.vllm.engines=32"),
        (
            {"engine": "vllm", "vllm": {"max_model_len": 999}},
            r"rollout.agent.vllm.max_model_len=999",
        ),
        ({"failure_reward": float("nan")}, r"rollout.agent.failure_reward=nan"),
        ({"concurrency": 0}, r"concurrency"),
    ],
)
def test_agent_section_mistakes(change, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_example(**change))


def test_several_vllm_engines_are_routed_and_each_synced():
    from unirl.core.protocols.source_plugin import SOURCES

    cfg = config_from_dict(_example(engine="vllm", vllm={"engines": 2}))
    plugin = SOURCES.get("agent")
    assert plugin.weights(cfg) == "every_rank"  # each engine's leader receives the weights
    assert plugin.weights(config_from_dict(_example(engine="vllm"))) == "rank0"
    engine = plugin.describe(cfg)["engine"]
    assert "2 vLLM engines" in engine and "fewest open episodes" in engine


def test_sleep_mode_is_described_and_keeps_the_vllm_sources_rules():
    from unirl.core.protocols.source_plugin import SOURCES

    data = _example(engine="vllm", vllm={"sleep": "offload"})
    assert (
        "wake before each rollout" in SOURCES.get("agent").describe(config_from_dict(data))["sleep"]
    )
    data["train"]["max_staleness"] = 1  # the vLLM source's rule, named under rollout.agent.vllm
    with pytest.raises(ConfigError, match=r"rollout.agent.vllm.sleep='offload' with train.max_st"):
        config_from_dict(data)


def test_check_says_when_the_fit_is_checked_again_after_the_first_step():
    """The fit check after RL step 1 runs for the agent's vLLM engines as for the vLLM source's
    (before the sync that wakes a sleeping engine), and not with rollouts generated ahead, whose
    worker owns the ranks' exchange: `unirl check` says which."""
    from unirl.core.protocols.source_plugin import SOURCES

    agent = SOURCES.get("agent")
    sleeping = agent.describe(config_from_dict(_example(engine="vllm", vllm={"sleep": "offload"})))
    said = sleeping["fit_after_first_step"]
    assert said.startswith("on a GPU, after the trainer's first RL step and before its weight")
    assert "rollout.agent.vllm.gpu_memory_utilization" in said and "the run stops" in said
    data = _example(engine="vllm")
    data["train"]["max_staleness"] = 1
    ahead = agent.describe(config_from_dict(data))["fit_after_first_step"]
    assert ahead.startswith("off: with rollouts generated ahead (train.max_staleness=1)")
    assert "fit_after_first_step" not in agent.describe(config_from_dict(_example()))  # sampler


def test_agent_with_an_environment_is_refused():
    data = _example()
    data["rollout"]["environment"] = "hidden_number"
    with pytest.raises(ConfigError, match=r"rollout.environment='hidden_number' with rollout."):
        config_from_dict(data)


def test_the_agent_function_is_loaded_by_module_or_file(tmp_path):
    assert load_agent("tests.unit.gateway_agents:tool_agent").__name__ == "tool_agent"
    assert load_agent("examples/tiny_agent.py:agent").__name__ == "agent"
    with pytest.raises(ConfigError, match=r"module 'no_such_module' cannot be imported"):
        load_agent("no_such_module:agent")
    with pytest.raises(ConfigError, match=r"has no function 'nope'"):
        load_agent("tests.unit.gateway_agents:nope")
    with pytest.raises(ConfigError, match=r"missing.py is not a file"):
        load_agent(f"{tmp_path}/missing.py:agent")


def test_routing_replay_from_the_engine_is_refused_with_why():
    """Neither engine behind the gateway returns routed experts on the CPU (the sampler records
    none; vLLM's CPU build cannot run the runner that returns them): one error that says so and
    names what works."""
    data = _example()
    data["algorithm"]["routing_replay"] = "rollout"
    with pytest.raises(ConfigError, match=r"routing_replay: rollout .* the built-in sampler "
                       r"records none.*Model Runner V2.*routing_replay: record"):  # fmt: skip
        config_from_dict(data)
