"""unirl's policy losses registered in verl's registry give verl's own numbers where the formulas
coincide: loss, gradient and verl's metrics, against verl's functions on the same fp32 inputs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

if importlib.util.find_spec("verl") is None:
    pytest.skip(
        "verl is not installed: `pip install --no-deps -r tests/requirements-nodeps.txt` "
        "(the README's test command does)",
        allow_module_level=True,
    )

from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from unirl.core.errors import ConfigError
from unirl.integrations import verl as unirl_verl

B, L = 6, 7


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 0, 1, 6])  # one empty response
    mask = torch.arange(L)[None, :] < lengths[:, None]
    log_prob = -torch.rand(B, L, generator=g) * 3
    old = log_prob + 0.3 * torch.randn(B, L, generator=g)
    old[0, :3] = log_prob[0, :3] - 1.5  # ratios e^1.5 = 4.5: past the dual-clip bound 3
    adv = torch.randn(B, generator=g)[:, None].expand(B, L).clone()
    adv[0] = -1.0
    weights = torch.rand(B, L, generator=g) * 2
    return old, log_prob, adv, mask, weights


def _config(loss_mode: str, dp_size=1, tokens=None, sequences=None, scale=None, **clip):
    cfg = ActorConfig(
        strategy="fsdp",
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        loss_scale_factor=scale,
        **clip,
    )
    cfg.global_batch_info.update(
        dp_size=dp_size,
        batch_num_tokens=tokens,
        global_batch_size=sequences,
        loss_scale_factor=scale,
    )
    return cfg


def _run(loss_mode: str, agg: str, cfg, use_weights: bool):
    old, log_prob, adv, mask, weights = _batch()
    log_prob.requires_grad_()
    fn = core_algos.get_policy_loss_fn(loss_mode)
    loss, metrics = fn(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg,
        config=cfg,
        rollout_is_weights=weights if use_weights else None,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
CASES = [
    # verl loss, unirl loss, config kwargs, global batch info
    ("vanilla", "ppo_clip", dict(clip_ratio_low=0.2, clip_ratio_high=0.28), {}),
    ("vanilla", "ppo_clip", dict(clip_ratio_c=2.0), dict(dp_size=2, tokens=40, sequences=10)),
    ("vanilla", "ppo_clip", {}, dict(scale=16)),
    ("gspo", "gspo", dict(clip_ratio_low=0.1, clip_ratio_high=0.15), {}),
    ("gspo", "gspo", {}, dict(dp_size=4, tokens=64, sequences=24)),
    ("cispo", "cispo", dict(clip_ratio_low=1.0, clip_ratio_high=0.3), {}),
    ("cispo", "cispo", {}, dict(dp_size=2, tokens=50, sequences=11, scale=9)),
]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("verl_name, unirl_name, clip, info", CASES)
@pytest.mark.parametrize("use_weights", [False, True])
def test_registered_unirl_loss_equals_verl(verl_name, unirl_name, clip, info, agg, use_weights):
    cfg = _config(f"unirl_{unirl_name}", **info, **clip)
    assert cfg.policy_loss.loss_mode in core_algos.POLICY_LOSS_REGISTRY  # selected by the config
    loss, grad, metrics = _run(cfg.policy_loss.loss_mode, agg, cfg, use_weights)
    ref_loss, ref_grad, ref_metrics = _run(
        verl_name, agg, _config(verl_name, **info, **clip), use_weights
    )

    assert grad.abs().max() > 0  # the case has a gradient to compare
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-6)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert metrics[key] == pytest.approx(ref_metrics[key], abs=1e-6), key


def test_the_case_exercises_clipping_and_dual_clip():
    """Guards the equality test: the batch reaches every branch of the clipped loss."""
    _, _, metrics = _run("vanilla", "token-mean", _config("vanilla"), False)
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    assert metrics["actor/pg_clipfrac_lower"] > 0


def test_every_unirl_loss_is_registered_under_its_prefix():
    names = set(core_algos.POLICY_LOSS_REGISTRY)
    assert {"unirl_ppo_clip", "unirl_gspo", "unirl_cispo", "unirl_reinforce"} <= names
    assert set(unirl_verl.VERL_LOSS_NAMES) <= names


def test_token_sum_has_no_unirl_counterpart():
    with pytest.raises(ConfigError, match="token-sum"):
        _run("unirl_ppo_clip", "token-sum", _config("unirl_ppo_clip"), False)


def test_readme_snippet_runs_as_written():
    from tests.unit.doc_snippets import doc_snippet

    scope: dict = {}
    exec(doc_snippet("guides/integrations.md", "verl"), scope)
    assert scope["loss_fn"] is core_algos.POLICY_LOSS_REGISTRY["unirl_gspo"]


def _actor_loss(loss_mode: str, agg: str):
    """verl's actor loss (`verl.workers.utils.losses.ppo_loss`, what its engines call per
    microbatch): the model's packed log-probs, the data as a TensorDict, the loss chosen by
    ``config.policy_loss.loss_mode``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    g = torch.Generator().manual_seed(5)
    b, p, r = 4, 2, 5
    response_mask = (torch.arange(r)[None] < torch.tensor([5, 2, 4, 1])[:, None]).long()
    attention_mask = torch.cat([torch.ones(b, p, dtype=torch.long), response_mask], 1)
    log_probs = (-torch.rand(int(attention_mask.sum()), generator=g)).requires_grad_()
    data = TensorDict(
        {
            "prompts": torch.randint(3, 9, (b, p), generator=g),
            "responses": torch.randint(3, 9, (b, r), generator=g),
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "old_log_probs": -torch.rand(b, r, generator=g),
            "advantages": torch.randn(b, generator=g)[:, None].expand(b, r).clone(),
        },
        batch_size=[b],
    )
    tu.assign_non_tensor(data, dp_size=2, batch_num_tokens=20, global_batch_size=8)
    cfg = _config(loss_mode, loss_agg_mode=agg)
    loss, metrics = ppo_loss(cfg, {"log_probs": log_probs}, data)
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(
    "verl_name, unirl_name", [("vanilla", "ppo_clip"), ("gspo", "gspo"), ("cispo", "cispo")]
)
def test_verl_actor_loss_selects_the_unirl_loss_by_config(verl_name, unirl_name, agg):
    loss, grad, metrics = _actor_loss(f"unirl_{unirl_name}", agg)
    ref_loss, ref_grad, _ = _actor_loss(verl_name, agg)
    assert grad.abs().max() > 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-6)
    assert "actor/unirl/pg_loss" in metrics  # the unirl loss really ran


def test_readme_config_lines_name_real_verl_keys():
    """The verl overrides of docs/guides/integrations.md: each key exists in verl's config classes, the external lib
    imports through verl's own importer, and the loss mode is then registered."""
    import dataclasses

    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import HFModelConfig

    from tests.unit.doc_snippets import doc_snippet

    overrides = dict(
        line.split("=", 1)
        for line in doc_snippet("guides/integrations.md", "verl-config", "").splitlines()
    )
    actor = _config("vanilla")
    for key, value in overrides.items():
        if key.startswith("actor_rollout_ref.model."):
            field = key.removeprefix("actor_rollout_ref.model.")
            assert field in {f.name for f in dataclasses.fields(HFModelConfig)}, key
            import_external_libs(value)
        else:
            obj = actor
            for part in key.removeprefix("actor_rollout_ref.actor.").split("."):
                obj = getattr(obj, part)  # AttributeError: not a verl actor key
    assert (
        overrides["actor_rollout_ref.actor.policy_loss.loss_mode"]
        in core_algos.POLICY_LOSS_REGISTRY
    )
