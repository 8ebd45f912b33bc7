"""head_loss (the loss inside the fused head) on the CPU against plain fp64 PyTorch written here:
full logits -> log_softmax -> the per-token loss formula written out (PPO-clip with an entropy
bonus over the step's global token count; REINFORCE with a KL term, mean over sequences of the
token mean), autograd's gradients of the hidden states and the weight; and which losses take the
path (`choose_head_path`)."""

from __future__ import annotations

import pytest
import torch

from unirl.core.data.counts import GlobalCounts
from unirl.core.errors import LossInputError
from unirl.core.maths.head_loss import choose_head_path, head_loss
from unirl.core.maths.losses import LossInputs, LossSettings, compute_loss

TEMPERATURE = 0.7
CLIP = 0.2
ENT_COEF = 0.01
KL_COEF = 0.1
# the step's global valid-token count: more than this microbatch's (other microbatches / ranks)
N_GLOBAL = 40
SEQ_LEN = 4  # tokens per sequence in the test data (the last sequence may be shorter)


def make(
    n_tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, seed: int, n_ids: int
) -> dict[str, torch.Tensor]:
    """A problem: hidden, weight (rows >= n_ids scaled up: padding that would dominate if
    counted), targets, and the per-token loss data (old and reference log-probs, advantages,
    loss mask, sequence ids and GLOBAL per-sequence valid counts)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_tokens, hidden_size, generator=g).to(dtype)
    weight = torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 3
    weight[n_ids:] *= 20
    targets = torch.randint(0, n_ids, (n_tokens,), generator=g)
    # old log-probs near the current ones so that some ratios clip and some do not
    old = -3.0 + torch.randn(n_tokens, generator=g) * 0.5
    seq_ids = torch.arange(n_tokens) // SEQ_LEN
    mask = (torch.rand(n_tokens, generator=g) > 0.25).float()
    num_seqs = int(seq_ids.max()) + 1 if n_tokens else 0
    local = torch.zeros(num_seqs).index_add(0, seq_ids, mask)
    return {
        "hidden": hidden,
        "weight": weight.to(dtype),
        "targets": targets,
        "old": old,
        "ref": old + torch.randn(n_tokens, generator=g) * 0.2,
        "adv": torch.randn(n_tokens, generator=g),
        "mask": mask,
        "seq_ids": seq_ids,
        "seq_counts": (local + 1).long(),  # a token of each sequence lives on another CP rank
    }


def ppo_reference_terms(logp, entropy, p):
    """PPO-clip minus the entropy bonus per token, summed over valid tokens / N_GLOBAL."""
    ratio = torch.exp(logp - p["old"].double())
    adv = p["adv"].double()
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP))
    return (p["mask"].double() * (pg - ENT_COEF * entropy)).sum() / N_GLOBAL


def reinforce_kl_reference_terms(logp, entropy, p):
    """(-A logp + KL_COEF * clamp(k3)) averaged over each sequence's GLOBAL valid tokens, then
    summed over sequences / the global sequence count."""
    ref = p["ref"].double()
    k3 = (torch.exp(ref - logp) - (ref - logp) - 1).clamp(-10, 10)
    total = -p["adv"].double() * logp + KL_COEF * k3
    n_i = p["seq_counts"].double()[p["seq_ids"]]
    return (p["mask"].double() * total / n_i).sum() / n_sequences(p)


def n_sequences(p) -> int:
    return int(p["seq_counts"].numel()) + 3  # three more sequences elsewhere in the step


CASES = {
    "ppo_entropy": (
        ppo_reference_terms,
        LossSettings(policy_loss="ppo_clip", clip_low=CLIP, clip_high=CLIP, entropy_coef=ENT_COEF),
    ),
    "reinforce_kl_seq_mean": (
        reinforce_kl_reference_terms,
        LossSettings(
            policy_loss="reinforce",
            loss_aggregation="seq-mean-token-mean",
            kl_loss_coef=KL_COEF,
            kl_loss_estimator="low_var_kl",
        ),
    ),
}


def reference(p, terms, *, temperature: float, vocab_size: int) -> dict[str, torch.Tensor]:
    """fp64: full logits, log_softmax + gather, entropy, the loss formula, autograd."""
    h = p["hidden"].to(torch.float64, copy=True).requires_grad_(True)
    w = p["weight"].to(torch.float64, copy=True).requires_grad_(True)
    logp_all = torch.log_softmax((h @ w.T)[:, :vocab_size] / temperature, dim=-1)
    logp = logp_all.gather(1, p["targets"][:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = terms(logp, entropy, p)
    loss.backward()
    return {"loss": loss.detach(), "logp": logp.detach(), "entropy": entropy.detach(),
            "dh": h.grad, "dw": w.grad}  # fmt: skip


def core_loss(p, settings: LossSettings, group=None):
    """The backend's loss_fn with its microbatch bound: core's compute_loss."""
    counts = GlobalCounts(tokens=N_GLOBAL, sequences=n_sequences(p))

    def loss(logp: torch.Tensor, entropy: torch.Tensor | None):
        dt = logp.dtype
        out = compute_loss(
            LossInputs(
                logprobs=logp,
                old_logprobs=p["old"].to(dt),
                ref_logprobs=p["ref"].to(dt),
                advantages=p["adv"].to(dt),
                loss_mask=p["mask"].to(dt),
                seq_ids=p["seq_ids"],
                num_seqs=int(p["seq_counts"].numel()),
                seq_token_counts=p["seq_counts"],
                entropy=entropy,
                cp_group=group,
            ),
            counts,
            settings,
            validate=False,
        )
        return out.loss, out.metrics

    return loss


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# (vocab rows, true vocabulary, token chunk): several chunks with a ragged last one, padding rows,
# one chunk, the default
SHAPES = ((37, 37, 5), (37, 29, 4), (37, 37, 64), (300, 297, None))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("vocab,n_ids,chunk", SHAPES)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_loss_and_gradients_match_fp64(case, vocab, n_ids, chunk, dtype) -> None:
    terms, settings = CASES[case]
    p = make(23, 16, vocab, dtype, 3, n_ids)
    ref = reference(p, terms, temperature=TEMPERATURE, vocab_size=n_ids)
    h = p["hidden"].clone().requires_grad_(True)
    w = p["weight"].clone().requires_grad_(True)
    out = head_loss(
        h,
        w,
        p["targets"],
        core_loss(p, settings),
        temperature=TEMPERATURE,
        vocab_size=n_ids,
        with_entropy=True,
        entropy_grad=settings.entropy_coef != 0,
        chunk_size=chunk,
    )
    (out.loss * 0.5).backward()  # the backend's loss scale reaches both gradients
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    grad_tol = 1e-10 if dtype == torch.float64 else 1e-4  # fp32: sums of cancelling terms
    assert abs(out.loss.item() - ref["loss"].item()) <= tol * abs(ref["loss"].item())
    assert rel_err(out.logprobs, ref["logp"]) < tol
    assert rel_err(out.entropy, ref["entropy"]) < tol
    assert not out.logprobs.requires_grad and not out.entropy.requires_grad
    assert rel_err(h.grad, 0.5 * ref["dh"]) < grad_tol
    assert rel_err(w.grad[:n_ids], 0.5 * ref["dw"][:n_ids]) < grad_tol
    assert torch.all(w.grad[n_ids:] == 0), "padding rows get no gradient"
    mask = p["mask"].double()
    ent = out.metrics["entropy"]
    mean_entropy = (mask * ref["entropy"]).sum() / mask.sum()
    assert abs(float(ent.numerator) / float(ent.denominator) - mean_entropy.item()) < tol


def test_bf16_inputs_match_fp64() -> None:
    terms, settings = CASES["ppo_entropy"]
    p = make(23, 16, 37, torch.bfloat16, 5, 31)
    ref = reference(p, terms, temperature=TEMPERATURE, vocab_size=31)
    h = p["hidden"].clone().requires_grad_(True)
    w = p["weight"].clone().requires_grad_(True)
    out = head_loss(
        h, w, p["targets"], core_loss(p, settings), temperature=TEMPERATURE, vocab_size=31,
        with_entropy=True, chunk_size=6,
    )  # fmt: skip
    out.loss.backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert rel_err(out.logprobs, ref["logp"]) < 1e-5  # fp32 arithmetic on the bf16 inputs
    assert rel_err(h.grad, ref["dh"]) < 8e-3  # bf16 rounding of the gradients
    assert rel_err(w.grad[:31], ref["dw"][:31]) < 8e-3


def test_only_weight_or_no_grad() -> None:
    """A frozen trunk (only the head trains); and a forward under no_grad gives the value only."""
    terms, settings = CASES["ppo_entropy"]
    p = make(9, 8, 20, torch.float64, 1, 20)
    ref = reference(p, terms, temperature=1.0, vocab_size=20)
    w = p["weight"].clone().requires_grad_(True)
    loss = core_loss(p, settings)
    out = head_loss(p["hidden"], w, p["targets"], loss, with_entropy=True, chunk_size=4)
    out.loss.backward()
    assert rel_err(w.grad, ref["dw"]) < 1e-10
    with torch.no_grad():
        out = head_loss(p["hidden"], w, p["targets"], loss, with_entropy=True)
    assert not out.loss.requires_grad
    assert abs(out.loss.item() - ref["loss"].item()) < 1e-10


def test_backward_twice_is_refused() -> None:
    p = make(6, 8, 10, torch.float64, 2, 10)
    h = p["hidden"].clone().requires_grad_(True)
    out = head_loss(h, p["weight"], p["targets"], core_loss(p, CASES["ppo_entropy"][1]),
                    with_entropy=True)  # fmt: skip
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.loss.backward()


def test_empty_microbatch() -> None:
    p = make(0, 8, 10, torch.float32, 2, 10)
    w = p["weight"].clone().requires_grad_(True)
    h = p["hidden"].clone().requires_grad_(True)
    out = head_loss(h, w, p["targets"], core_loss(p, CASES["ppo_entropy"][1]), with_entropy=True)
    out.loss.backward()
    assert out.loss.item() == 0 and torch.all(w.grad == 0) and h.grad.shape == (0, 8)


def test_bad_input_names_the_argument() -> None:
    p = make(5, 8, 10, torch.float32, 2, 10)
    with pytest.raises(LossInputError, match="head_loss: hidden has 8 features but weight"):
        head_loss(p["hidden"], p["weight"][:, :4], p["targets"], core_loss(p, LossSettings()))


@pytest.mark.parametrize(
    "settings,in_head,words",
    [
        (LossSettings(), True, "policy_loss 'ppo_clip' with token-mean"),
        (LossSettings(policy_loss="cispo", entropy_coef=0.01), True, "entropy term"),
        (LossSettings(policy_loss="reinforce", kl_loss_coef=0.1), True, "KL term"),
        (LossSettings(policy_loss="sft", loss_aggregation="seq-mean-token-mean"), True, "sft"),
        (LossSettings(rollout_correction="tis"), True, "rollout_correction 'tis'"),
        (LossSettings(policy_loss="gspo"), False, "policy_loss 'gspo' is not separable"),
        (LossSettings(rollout_correction="seq_mask"), False, "'seq_mask' weighs each sequence"),
        (
            LossSettings(policy_loss="tests.unit.custom_components:undeclared_loss"),
            False,
            "set `fn.separable = True`",
        ),
    ],
)
def test_choose_head_path(settings, in_head, words) -> None:
    path = choose_head_path(settings)
    assert path.loss_in_head is in_head
    assert words in path.reason
    assert ("3 head matmuls" if in_head else "4 head matmuls") in path.reason


def test_backend_entry_binds_the_microbatch() -> None:
    """`token_loss_from_hidden`: the backend's loss_fn gets its microbatch at every call, and the
    spec's temperature, vocabulary and entropy settings reach the head."""
    from unirl.core.backend import LogprobSpec, token_loss_from_hidden
    from unirl.core.data.microbatch import TrainMicrobatch

    terms, settings = CASES["ppo_entropy"]
    p = make(12, 8, 30, torch.float64, 4, 27)
    ref = reference(p, terms, temperature=TEMPERATURE, vocab_size=27)
    n = p["targets"].numel()
    mb = TrainMicrobatch(
        sample_indices=(0, 1, 2),
        tokens=p["targets"],
        position_ids=torch.arange(n) % SEQ_LEN,
        cu_seqlens=torch.arange(0, n + 1, SEQ_LEN, dtype=torch.int32),
        targets=p["targets"],
        loss_mask=p["mask"],
        seq_ids=p["seq_ids"],
        seq_token_counts=p["seq_counts"],
    )
    seen = []

    def loss_fn(got_mb, logp, entropy):
        seen.append(got_mb)
        return core_loss(p, settings)(logp, entropy)

    h = p["hidden"].clone().requires_grad_(True)
    spec = LogprobSpec(temperature=TEMPERATURE, vocab_size=27, with_entropy=True, entropy_grad=True)
    out = token_loss_from_hidden(h, p["weight"], mb, spec, loss_fn)
    out.loss.backward()
    assert seen and all(s is mb for s in seen)
    assert abs(out.loss.item() - ref["loss"].item()) < 1e-10
    assert rel_err(h.grad, ref["dh"]) < 1e-10
