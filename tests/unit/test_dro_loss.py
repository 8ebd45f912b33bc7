"""`dro` (unirl.core.maths.losses.dro) against its formula written out: the per-token loss
-(logp A - beta/2 (logp - q)^2) and its gradient -(A - beta (logp - q)) on hand-picked values."""

from __future__ import annotations

import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.maths.losses.inputs import LossInputs
from unirl.core.maths.losses.registry import get_policy_loss
from unirl.core.maths.losses.settings import LossSettings


def test_dro_loss_and_gradient_by_hand():
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    q = torch.tensor([-1.0, -1.0, -1.5])  # the sampler's log-probs
    adv = torch.tensor([1.0, -2.0, 0.5])
    inp = LossInputs(
        logprobs=logp,
        advantages=adv,
        loss_mask=torch.ones(3),
        seq_ids=torch.zeros(3, dtype=torch.long),
        num_seqs=1,
        seq_token_counts=torch.tensor([3]),
        old_logprobs=q,
    )
    settings = LossSettings(policy_loss="dro", dro_beta=0.4)
    loss_t, _ = get_policy_loss("dro")(inp, GlobalCounts(tokens=3, sequences=1), settings)
    # token 0: -(-1 * 1 - 0.2 * 0^2) = 1; token 1: -(-0.5 * -2 - 0.2 * 0.5^2) = -0.95;
    # token 2: -(-2 * 0.5 - 0.2 * (-0.5)^2) = 1.05
    torch.testing.assert_close(loss_t, torch.tensor([1.0, -0.95, 1.05]))
    loss_t.sum().backward()
    # -(A - beta (logp - q)): -(1 - 0) = -1; -(-2 - 0.4 * 0.5) = 2.2; -(0.5 + 0.2) = -0.7
    torch.testing.assert_close(logp.grad, torch.tensor([-1.0, 2.2, -0.7]))
