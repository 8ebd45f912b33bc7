"""`stable_reinforce` (unirl.core.maths.losses.stable_reinforce) against its formula written out
per token in plain Python floats: loss_t = -(A_t logp_t - c ((rho_t - 1) - log rho_t)) with
rho_t = exp(logp_t - q_t), and its gradient -(A_t - c (rho_t - 1)); hand-picked values first."""

from __future__ import annotations

import math

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.registry import get_policy_loss, policy_loss_is_separable
from unirl.core.maths.losses.settings import LossSettings


def _run(
    logp: torch.Tensor,
    q: torch.Tensor,
    adv: torch.Tensor,
    coef: float,
    behaviour: torch.Tensor | None = None,
) -> torch.Tensor:
    n = logp.numel()
    inp = LossInputs(
        logprobs=logp,
        advantages=adv,
        loss_mask=torch.ones(n),
        seq_ids=torch.zeros(n, dtype=torch.long),
        num_seqs=1,
        seq_token_counts=torch.tensor([n]),
        old_logprobs=q,
        rollout_logprobs=behaviour,
    )
    settings = LossSettings(policy_loss="stable_reinforce", stable_reinforce_kl_coef=coef)
    loss_t, _ = get_policy_loss("stable_reinforce")(
        inp, GlobalCounts(tokens=n, sequences=1), settings
    )
    return loss_t


def test_loss_and_gradient_by_hand():
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    q = torch.tensor([-1.0, -0.5 - math.log(2.0), -2.0 + math.log(2.0)])  # rho = 1, 2, 1/2
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss_t = _run(logp, q, adv, coef=0.4)
    # k3 = (rho - 1) - log rho: 0; 1 - ln 2 = 0.306853; -0.5 + ln 2 = 0.193147
    # token 0: -(-1 * 1 - 0) = 1; token 1: -(-0.5 * -2 - 0.4 * 0.306853) = -0.877259;
    # token 2: -(-2 * 0.5 - 0.4 * 0.193147) = 1.077259
    torch.testing.assert_close(loss_t, torch.tensor([1.0, -0.877259, 1.077259]))
    loss_t.sum().backward()
    # -(A - c (rho - 1)): -(1 - 0) = -1; -(-2 - 0.4 * 1) = 2.4; -(0.5 + 0.4 * 0.5) = -0.7
    torch.testing.assert_close(logp.grad, torch.tensor([-1.0, 2.4, -0.7]))


def test_matches_a_per_token_loop_and_is_reinforce_on_policy():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(11, generator=g) * 3).requires_grad_()
    q = logp.detach() + torch.randn(11, generator=g) * 0.5
    adv = torch.randn(11, generator=g)
    coef = 0.3
    loss_t = _run(logp, q, adv, coef)
    loss_t.sum().backward()
    for t in range(11):
        lp, qt, a = float(logp.detach()[t]), float(q[t]), float(adv[t])
        rho = math.exp(lp - qt)
        want = -(a * lp - coef * ((rho - 1.0) - (lp - qt)))
        want_grad = -(a - coef * (rho - 1.0))
        assert abs(float(loss_t.detach()[t]) - want) < 1e-5, t
        assert abs(float(logp.grad[t]) - want_grad) < 1e-5, t
    # on-policy (the reused log-probs: rho = 1) it is REINFORCE, -A logp, whatever the weight
    on = _run(logp.detach(), logp.detach(), adv, coef=5.0)
    torch.testing.assert_close(on, -adv * logp.detach())
    assert policy_loss_is_separable("stable_reinforce")


def test_the_sampler_is_the_behaviour_policy_when_the_batch_has_it():
    """Under `unirl train` the rollout engine sampled the tokens: its log-probs are q, not the
    proximal ones (one token, logp -1, engine -1 - ln 2: rho = 2, k3 = 1 - ln 2)."""
    logp = torch.tensor([-1.0])
    engine = torch.tensor([-1.0 - math.log(2.0)])
    got = _run(logp, logp.clone(), torch.tensor([0.0]), coef=1.0, behaviour=engine)
    torch.testing.assert_close(got, torch.tensor([1.0 - math.log(2.0)]))


def test_a_penalty_weight_for_another_loss_is_refused_by_unirl_check(capsys):
    """``algorithm.stable_reinforce_kl_coef`` (and DRO's ``dro_beta``) is read by one loss only:
    set beside another ``policy_loss`` it would change nothing, so `unirl check` (the config
    `unirl train` builds) refuses it, naming the key, its value and the fix."""
    from pathlib import Path

    from unirl.cli import main

    tiny = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"
    for key, loss in (("stable_reinforce_kl_coef", "stable_reinforce"), ("dro_beta", "dro")):
        assert main(["check", str(tiny), "--set", f"algorithm.{key}=0.1"]) == 2
        err = capsys.readouterr().err
        assert f"algorithm.{key}=0.1" in err
        assert f"algorithm.policy_loss: {loss}" in err
        argv = ["check", str(tiny), "--set", f"algorithm.{key}=0.1"]
        argv += ["--set", f"algorithm.policy_loss={loss}"]
        assert main(argv) == 0, capsys.readouterr().err
        capsys.readouterr()
