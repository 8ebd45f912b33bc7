"""logprobs_from_logits on the CPU (PyTorch path) against fp64 references written here."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.core.errors import LossInputError
from unirl.core.maths.logprobs import logprobs_from_logits


def ref_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 log_softmax + gather and -sum p log p over the first ``vocab_size`` columns."""
    z = logits.double()
    if vocab_size is not None:
        z = z[:, :vocab_size]
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def ref_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    w_logp: torch.Tensor,
    w_entropy: torch.Tensor | None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """d/dlogits of sum(w_logp * logp) (+ sum(w_entropy * H)), fp64 autograd; 0 on padding."""
    x = logits.double().detach().requires_grad_(True)
    logp, entropy = ref_logprobs_entropy(x, targets, temperature, vocab_size)
    loss = (w_logp.double() * logp).sum()
    if w_entropy is not None:
        loss = loss + (w_entropy.double() * entropy).sum()
    loss.backward()
    return x.grad


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_inputs(
    n_tokens: int, vocab: int, dtype: torch.dtype, seed: int, vocab_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_tokens, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab_size or vocab, (n_tokens,), generator=g)
    return logits, targets


# tolerance on ||out - ref|| / ||ref||: the forward is fp32 arithmetic on the given inputs; a bf16
# gradient is rounded to bf16 (relative step 2**-8)
FWD_TOL = 1e-5
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


def test_hand_computed_two_tokens() -> None:
    # row 0: logits [0, ln 3] -> p = [1/4, 3/4]; target 1 -> logp = ln(3/4) = -0.287682...
    #   H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.346574 + 0.215762 = 0.562335
    #   d logp / d logits = onehot - p = [-1/4, +1/4]
    # row 1: logits [ln 2, ln 2] at temperature 1 -> p = [1/2, 1/2]; target 0 -> logp = -ln 2
    #   H = ln 2; d logp / d logits = [1/2, -1/2]
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(2.0), math.log(2.0)]])
    logits.requires_grad_(True)
    targets = torch.tensor([1, 0])
    logp, entropy = logprobs_from_logits(logits, targets, with_entropy=True)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75), -math.log(2.0)]))
    h0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy, torch.tensor([h0, math.log(2.0)]))
    logp.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.25, 0.25], [0.5, -0.5]]))


def test_temperature_hand_computed() -> None:
    # logits [0, 2 ln 3] at temperature 2 -> z = [0, ln 3] -> p = [1/4, 3/4]
    # d logp_1 / d logits = (onehot - p) / T = [-1/8, +1/8]
    logits = torch.tensor([[0.0, 2.0 * math.log(3.0)]], requires_grad=True)
    logp = logprobs_from_logits(logits, torch.tensor([1]), temperature=2.0)
    torch.testing.assert_close(logp, torch.tensor([math.log(0.75)]))
    logp.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.125, 0.125]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 3, 1000, None])
def test_forward_backward_match_fp64(dtype, temperature, chunk_size) -> None:
    logits, targets = make_inputs(11, 37, dtype, seed=1)
    w = torch.randn(11, generator=torch.Generator().manual_seed(2))
    x = logits.clone().requires_grad_(True)
    logp = logprobs_from_logits(x, targets, temperature=temperature, chunk_size=chunk_size)
    assert logp.dtype == torch.float32 and logp.shape == (11,)
    ref, _ = ref_logprobs_entropy(logits, targets, temperature)
    assert rel_err(logp, ref) < FWD_TOL
    (w * logp).sum().backward()
    assert x.grad.dtype == dtype
    assert rel_err(x.grad, ref_grad(logits, targets, temperature, w, None)) < GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [1, 3, None])
def test_entropy_and_its_gradient(dtype, chunk_size) -> None:
    logits, targets = make_inputs(9, 23, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    w_logp, w_ent = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    x = logits.clone().requires_grad_(True)
    logp, entropy = logprobs_from_logits(
        x, targets, temperature=0.8, chunk_size=chunk_size, with_entropy=True
    )
    ref_logp, ref_ent = ref_logprobs_entropy(logits, targets, 0.8)
    assert rel_err(logp, ref_logp) < FWD_TOL
    assert rel_err(entropy, ref_ent) < FWD_TOL
    ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
    expected = ref_grad(logits, targets, 0.8, w_logp, w_ent)
    assert rel_err(x.grad, expected) < GRAD_TOL[dtype]


def test_entropy_only_loss_has_gradient() -> None:
    logits, targets = make_inputs(6, 13, torch.float32, seed=5)
    x = logits.clone().requires_grad_(True)
    _, entropy = logprobs_from_logits(x, targets, with_entropy=True, chunk_size=4)
    entropy.sum().backward()
    # d/dlogits of sum(0 * logp + 1 * H)
    assert rel_err(x.grad, ref_grad(logits, targets, 1.0, torch.zeros(6), torch.ones(6))) < 1e-5


def test_entropy_gradient_skipped_when_not_requested() -> None:
    logits, targets = make_inputs(8, 19, torch.float32, seed=6)
    w = torch.randn(8, generator=torch.Generator().manual_seed(7))
    x = logits.clone().requires_grad_(True)
    logp, entropy = logprobs_from_logits(
        x, targets, temperature=1.3, with_entropy=True, entropy_grad=False
    )
    # the entropy's value is still right, but it carries no gradient
    assert rel_err(entropy, ref_logprobs_entropy(logits, targets, 1.3)[1]) < FWD_TOL
    assert not entropy.requires_grad
    (w * logp).sum().backward()
    assert rel_err(x.grad, ref_grad(logits, targets, 1.3, w, None)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_vocabulary_is_excluded(dtype) -> None:
    vocab_size, padded = 29, 32
    logits, targets = make_inputs(7, padded, dtype, seed=8, vocab_size=vocab_size)
    logits[:, vocab_size:] = 50.0  # padding that would dominate the softmax if counted
    gen = torch.Generator().manual_seed(9)
    w_logp, w_ent = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    x = logits.clone().requires_grad_(True)
    logp, entropy = logprobs_from_logits(
        x, targets, vocab_size=vocab_size, with_entropy=True, chunk_size=3
    )
    ref_logp, ref_ent = ref_logprobs_entropy(logits, targets, 1.0, vocab_size)
    assert rel_err(logp, ref_logp) < FWD_TOL
    assert rel_err(entropy, ref_ent) < FWD_TOL
    ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
    # the reference slices the padding off, so its gradient there is 0
    expected = ref_grad(logits, targets, 1.0, w_logp, w_ent, vocab_size)
    assert torch.all(expected[:, vocab_size:] == 0)
    assert rel_err(x.grad, expected) < GRAD_TOL[dtype]
    assert torch.all(x.grad[:, vocab_size:] == 0)


def test_row_strided_view() -> None:
    base, targets = make_inputs(5, 40, torch.float32, seed=10, vocab_size=31)
    x = base.clone().requires_grad_(True)
    view = x[:, :31]  # rows 40 apart in memory
    logp = logprobs_from_logits(view, targets, chunk_size=2)
    assert rel_err(logp, ref_logprobs_entropy(base[:, :31], targets, 1.0)[0]) < FWD_TOL
    logp.sum().backward()
    assert rel_err(x.grad[:, :31], ref_grad(base[:, :31], targets, 1.0, torch.ones(5), None)) < 1e-5
    assert torch.all(x.grad[:, 31:] == 0)


def test_zero_tokens() -> None:
    x = torch.zeros(0, 17, requires_grad=True)
    logp, entropy = logprobs_from_logits(
        x, torch.zeros(0, dtype=torch.long), with_entropy=True, chunk_size=3
    )
    assert logp.shape == (0,) and entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert x.grad.shape == (0, 17)


def test_large_logits_are_stable() -> None:
    # logits near 1e4: exp() would overflow without the max shift
    logits, targets = make_inputs(4, 10, torch.float32, seed=11)
    logits = logits + 1e4
    logp, entropy = logprobs_from_logits(logits, targets, with_entropy=True)
    ref_logp, ref_ent = ref_logprobs_entropy(logits, targets, 1.0)
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-3, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_ent, atol=2e-2, rtol=0)


def _saved_tensors(fn) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_graph_saves_only_the_logits(dtype) -> None:
    n_tokens, vocab = 16, 64
    logits, targets = make_inputs(n_tokens, vocab, dtype, seed=12)
    x = logits.clone().requires_grad_(True)
    saved = _saved_tensors(
        lambda: logprobs_from_logits(x, targets, with_entropy=True, chunk_size=4)[1]
    )
    big = [t for t in saved if t.numel() >= n_tokens * vocab]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr() and big[0].dtype == dtype
    # besides the logits: targets (int64), logsumexp and E[z] (fp32), [T] each
    small_bytes = sum(t.numel() * t.element_size() for t in saved if t is not big[0])
    assert small_bytes <= n_tokens * (8 + 4 + 4)

    # the same hook sees the naive form keep fp32 copies of logits' size: the check can fail
    naive = _saved_tensors(
        lambda: torch.log_softmax(x.float(), -1).gather(1, targets[:, None]).sum()
    )
    assert sum(t.numel() * t.element_size() for t in naive) >= n_tokens * vocab * 4


def test_entropy_without_gradient_saves_less() -> None:
    logits, targets = make_inputs(16, 64, torch.float32, seed=13)
    x = logits.clone().requires_grad_(True)
    with_grad = _saved_tensors(lambda: logprobs_from_logits(x, targets, with_entropy=True))
    without = _saved_tensors(
        lambda: logprobs_from_logits(x, targets, with_entropy=True, entropy_grad=False)
    )
    # E[z] ([T] fp32) is saved only when the entropy's gradient is wanted
    assert sum(t.numel() for t in with_grad) - sum(t.numel() for t in without) == 16


# --- bad input ----------------------------------------------------------------------------------


def test_rejects_bad_logits_shape() -> None:
    with pytest.raises(LossInputError, match=r"logits must be a 2-D tensor .*\(2, 3, 5\)"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(6, dtype=torch.long))


def test_rejects_integer_logits() -> None:
    with pytest.raises(LossInputError, match=r"logits must be floating point.*int64"):
        logprobs_from_logits(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_rejects_token_count_mismatch() -> None:
    with pytest.raises(LossInputError, match="targets has 3 tokens but logits has 2 rows"):
        logprobs_from_logits(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))


def test_rejects_float_targets() -> None:
    with pytest.raises(LossInputError, match=r"targets must hold integer token ids.*float32"):
        logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2))


@pytest.mark.parametrize("bad_id", [-1, 5])
def test_rejects_targets_out_of_range(bad_id) -> None:
    targets = torch.tensor([0, bad_id, 1])
    with pytest.raises(LossInputError, match=rf"targets\[1\] = {bad_id} is outside .*\[0, 5\)"):
        logprobs_from_logits(torch.zeros(3, 5), targets)


def test_rejects_target_in_padding() -> None:
    with pytest.raises(LossInputError, match=r"targets\[0\] = 4 is outside .*\[0, 4\)"):
        logprobs_from_logits(torch.zeros(1, 5), torch.tensor([4]), vocab_size=4)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_rejects_bad_temperature(temperature) -> None:
    with pytest.raises(LossInputError, match="temperature must be a finite number > 0"):
        logprobs_from_logits(torch.zeros(1, 5), torch.tensor([0]), temperature=temperature)


def test_rejects_bad_chunk_size_and_vocab_size() -> None:
    with pytest.raises(LossInputError, match="chunk_size must be an int >= 1"):
        logprobs_from_logits(torch.zeros(1, 5), torch.tensor([0]), chunk_size=0)
    with pytest.raises(LossInputError, match=r"vocab_size=6 must be in \[1, 5\]"):
        logprobs_from_logits(torch.zeros(1, 5), torch.tensor([0]), vocab_size=6)


def test_triton_kernel_refused_on_cpu() -> None:
    with pytest.raises(LossInputError, match="kernel='triton' needs CUDA logits"):
        logprobs_from_logits(torch.zeros(1, 5), torch.tensor([0]), kernel="triton")
    with pytest.raises(LossInputError, match="kernel='cuda' is not one of"):
        logprobs_from_logits(torch.zeros(1, 5), torch.tensor([0]), kernel="cuda")


def test_target_range_check_is_left_out_only_when_asked() -> None:
    """``check_targets=False`` (the RL step checked the ids on the host) drops the range check
    alone, with its host sync: an in-range result is unchanged, and the other checks stay."""
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([4, 0, 2])
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs_from_logits(logits, targets, check_targets=False), want)
    with pytest.raises(LossInputError, match=r"targets\[1\] = 5 is outside the vocabulary"):
        logprobs_from_logits(logits, torch.tensor([0, 5, 1]))
    with pytest.raises(LossInputError, match="temperature must be a finite number > 0"):
        logprobs_from_logits(logits, targets, temperature=0.0, check_targets=False)


def test_rl_step_specs_rely_on_the_batch_check() -> None:
    """The RL step's log-prob specs skip the per-call check because `RLStep.run` validates the
    batch's ids first (`RolloutBatch.validate`, which rejects an id outside the vocabulary)."""
    from unirl.core.config.derived import forward_logprob_spec, train_logprob_spec
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.data.rollout import RolloutBatch
    from unirl.core.errors import RolloutDataError

    cfg = config_from_dict(
        {
            "model": {"hf_config": {"model_type": "llama", "hidden_size": 8}},
            "batch": {"max_tokens_per_microbatch": 4096},
        }
    )
    assert not train_logprob_spec(cfg, 8).targets_checked
    assert train_logprob_spec(cfg, 8, targets_checked=True).targets_checked
    assert forward_logprob_spec(cfg, 8, targets_checked=True).targets_checked
    record = {
        "prompt_tokens": [1, 2],
        "response_tokens": [3, 8],
        "rollout_logprobs": [-0.5, -0.5],
        "reward": 1.0,
        "group_id": 0,
    }
    batch = RolloutBatch.from_records([record])
    with pytest.raises(RolloutDataError, match="outside the vocabulary"):
        batch.validate(vocab_size=8, max_seq_len=16, samples_per_prompt=1)
