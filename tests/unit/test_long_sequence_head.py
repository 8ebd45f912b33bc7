"""A 4,096-token sequence (plus two shorter ones) through the long-sequence path on the CPU:
packing (`RolloutBatch.pack`), next-token shifting and context-parallel splitting over two ranks
(`CPLayout`), then the fused head on each rank's tokens (`head_loss`: the loss inside the head,
in token chunks; `logprobs_from_hidden`: forward log-probs) — against a plain fp32 PyTorch
reference on the whole unsplit stream: ``log_softmax(hidden @ W.T)`` of every target, the
token-sum loss, and its gradients by autograd.

The hidden states are a per-token function of the token and its position in its sequence
(an embedding plus a position table), so each rank computes its own from its split tokens and
`CPLayout.position_ids`: a wrong split or wrong global positions changes them. The two ranks'
losses must sum to the reference loss, their weight gradients too, and their hidden-state
gradients and log-probs, merged back (`merge_cp_pieces`), must equal the reference's.
"""

from __future__ import annotations

import torch

from unirl.core.data.context_parallel import CPLayout, merge_cp_pieces, shift_to_next_token
from unirl.core.data.rollout import RolloutBatch
from unirl.core.maths.head_loss import head_loss
from unirl.core.maths.logprobs_hidden import logprobs_from_hidden

VOCAB, HIDDEN, CP = 256, 32, 2
LENGTHS = (4096, 1531, 250)  # the long sequence, a mid one, a short one


def _batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    records = []
    for i, n in enumerate(LENGTHS):
        prompt = n // 8
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        records.append(
            {
                "prompt_tokens": ids[:prompt],
                "response_tokens": ids[prompt:],
                "reward": float(i),
                "group_id": 0,
            }
        )
    return RolloutBatch.from_records(records)


def test_a_4k_sequence_through_packing_cp_and_the_fused_head_matches_fp32_torch():
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    positions = torch.randn(max(LENGTHS), HIDDEN, generator=g) * 0.1
    weight = torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5
    mb = _batch().pack([0, 1, 2])
    cu = mb.cu_seqlens
    assert int(cu[-1]) == sum(LENGTHS) and int((cu[1:] - cu[:-1]).max()) == 4096
    targets = shift_to_next_token(mb.tokens, cu)
    mask = shift_to_next_token(mb.loss_mask, cu, fill=False).float()
    adv = torch.randn(mb.tokens.shape[0], generator=g) * mask
    n_valid = float(mask.sum())

    # the reference: plain fp32 on the whole unsplit stream
    hidden = (embed[mb.tokens] + positions[mb.position_ids]).requires_grad_(True)
    w_ref = weight.clone().requires_grad_(True)
    logp_ref = torch.log_softmax(hidden @ w_ref.T, dim=-1).gather(1, targets[:, None])[:, 0]
    loss_ref = -(adv * logp_ref).sum() / n_valid
    loss_ref.backward()

    losses, dweight, dhidden, logps, in_head = [], torch.zeros_like(weight), [], [], []
    for rank in range(CP):
        lay = CPLayout.build(cu, CP, rank)
        tokens, t_local = lay.split(mb.tokens), lay.split(targets)
        a_local = lay.split(adv)
        h = (embed[tokens] + positions[lay.position_ids]).requires_grad_(True)
        w = weight.clone().requires_grad_(True)

        def loss(logp, _entropy, a=a_local):  # separable: a sum over tokens
            return -(a * logp).sum() / n_valid, {}

        out = head_loss(h, w, t_local, loss, chunk_size=512)
        out.loss.backward()
        losses.append(out.loss.detach())
        dweight += w.grad
        dhidden.append(h.grad)
        in_head.append(out.logprobs)
        with torch.no_grad():
            logps.append(logprobs_from_hidden(h.detach(), weight, t_local, chunk_size=512))

    torch.testing.assert_close(sum(losses), loss_ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dweight, w_ref.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(merge_cp_pieces(dhidden, cu), hidden.grad, rtol=1e-4, atol=1e-7)
    for pieces in (logps, in_head):
        torch.testing.assert_close(
            merge_cp_pieces(pieces, cu), logp_ref.detach(), rtol=1e-5, atol=1e-5
        )
