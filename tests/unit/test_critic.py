"""The critic's config rules and core maths (hand-computed), without a backend."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.config.run_config import config_from_dict, critic_enabled, policy_rl_steps
from unirl.core.critic import critic_optimizer_steps, value_metrics
from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import ConfigError
from unirl.core.maths.losses import LossSettings, critic_loss

BASE = {
    "model": {"hf_config": {"model_type": "llama"}},
    "batch": {
        "prompts_per_rollout": 2,
        "samples_per_prompt": 4,
        "samples_per_optimizer_step": 4,
        "micro_batch_size": 2,
    },
    "train": {"rl_steps": 10},
}


def _cfg(**sections):
    data = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return config_from_dict(data, world_size=1)


def test_gae_turns_the_critic_on_and_grpo_leaves_it_off():
    assert critic_enabled(_cfg(algorithm={"advantage_estimator": "gae"}))
    assert not critic_enabled(_cfg())
    # gae with values from the rollout (a file's per-token 'values'): no critic
    assert not critic_enabled(
        _cfg(algorithm={"advantage_estimator": "gae"}, critic={"enabled": False})
    )


def test_a_critic_without_values_to_feed_is_refused():
    with pytest.raises(
        ConfigError, match=r"critic.enabled: true, but algorithm.advantage_estimator='grpo'"
    ):
        _cfg(critic={"enabled": True})


def test_critic_keys_without_a_critic_are_refused():
    with pytest.raises(ConfigError, match=r"critic.warmup_steps is set but no critic trains"):
        _cfg(critic={"warmup_steps": 2})
    with pytest.raises(
        ConfigError, match=r"critic.optimizer is set but no critic trains \(critic.enabled: false\)"
    ):
        _cfg(
            algorithm={"advantage_estimator": "gae"},
            critic={"enabled": False, "optimizer": {"lr": 1e-3}},
        )


def test_a_backend_without_a_critic_refuses_one_with_a_clear_message():
    """A plug-in that does not declare ``supports_critic`` (the test suite's toy backend)."""
    from tests.plugins import toy_backend
    from unirl.core.protocols.backend_plugin import BACKENDS

    BACKENDS.register("toy", toy_backend.PLUGIN)
    try:
        with pytest.raises(
            ConfigError, match=r"backend: toy has no critic .* use backend: deepspeed"
        ):
            _cfg(
                backend="toy",
                model={"hf_config": {"model_type": "llama", "vocab_size": 16}},
                algorithm={"advantage_estimator": "gae"},
            )
    finally:
        BACKENDS.unregister("toy")


def test_critic_bounds_name_their_keys():
    gae = {"advantage_estimator": "gae"}
    with pytest.raises(ConfigError, match=r"critic.warmup_steps=10 leaves the policy no RL step"):
        _cfg(algorithm=gae, critic={"warmup_steps": 10})
    with pytest.raises(ConfigError, match=r"critic.micro_batch_size x data-parallel size = 3 x 1"):
        _cfg(algorithm=gae, critic={"micro_batch_size": 3})
    with pytest.raises(ConfigError, match=r"critic.optimizer.lr must be"):
        _cfg(algorithm=gae, critic={"optimizer": {"lr": -1.0}})


def test_warmup_steps_count_for_the_critic_not_the_policy():
    cfg = _cfg(algorithm={"advantage_estimator": "gae"}, critic={"warmup_steps": 3})
    assert policy_rl_steps(cfg, 10) == 7
    # 8 samples per rollout / 4 per optimizer step = 2 steps per rollout
    assert critic_optimizer_steps(cfg, 7 * 2) == 10 * 2


def test_critic_loss_by_hand():
    # two sequences: [a, b] valid, [c, -, d] with one masked token
    values = torch.tensor([1.0, 0.5, 0.0, 9.0, -1.0], requires_grad=True)
    returns = torch.tensor([0.0, 0.5, 1.0, 0.0, 0.0])
    old = torch.tensor([0.9, 0.5, 0.5, 0.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    settings = LossSettings(value_clip=0.2, value_coef=0.5, loss_aggregation="token-mean")
    out = critic_loss(
        values, returns, old,
        loss_mask=mask, seq_ids=torch.tensor([0, 0, 1, 1, 1]), num_seqs=2,
        seq_token_counts=torch.tensor([2, 2]), counts=GlobalCounts(tokens=8, sequences=4),
        settings=settings,
    )  # fmt: skip
    # token 0: v 1.0, clipped 0.9+0.1 = 1.0 -> 0.5*1 = 0.5; token 1: 0;
    # token 2: v 0, clipped 0.5-0.2 = 0.3, errors 1 and 0.49 -> 0.5; token 4: (-1 - 0)^2 -> 0.5
    # sum 1.5 over the step's 8 tokens, times value_coef 0.5
    assert math.isclose(float(out.loss.detach()), 0.5 * 1.5 / 8)
    out.loss.backward()
    # d/dv of 0.5 * 0.5 (v - R)^2 / 8 = 0.5 (v - R) / 8 where the unclipped error is the max
    assert torch.allclose(values.grad, torch.tensor([0.5 / 8, 0.0, -0.5 / 8, 0.0, -0.5 / 8]))
    m = out.metrics["value_loss"]
    assert math.isclose(float(m.numerator) / float(m.denominator), 1.5 / 4)  # 4 valid tokens
    clip = out.metrics["vf_clipfrac"]
    assert float(clip.numerator) == 0.0  # token 2's clipped error 0.49 < 1


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 1.0, 7.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = value_metrics(values, returns, mask)
    # valid returns 1, 2, 3 (var 2/3), errors 0, 1, 0 (var 2/9): 1 - (2/9)/(2/3) = 2/3
    assert math.isclose(got["critic/explained_variance"], 1 - (2 / 9) / (2 / 3 + 1e-8))
    assert math.isclose(got["critic/values_mean"], 5 / 3)
    assert math.isclose(got["critic/returns_mean"], 2.0)
    assert math.isclose(got["critic/values_abs_error"], 1 / 3)
