"""DeepSpeedBackend in one process (world size 1) against plain transformers / PyTorch references
written here: per-sequence log-probs, one optimizer step under ZeRO 0-3 (gradient norm before
clipping, updated weights), the LR schedule, bit-exact resume, the HF export round trip.

The helpers at the top are shared with tests/distributed/test_deepspeed_dp.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from unirl.core.backend import TrainingBackend  # noqa: E402
from unirl.core.config.run_config import (  # noqa: E402
    BatchConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProgressConfig,
    UnirlConfig,
)
from unirl.core.data.microbatch import TrainMicrobatch  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402
from unirl.core.maths.losses import Metric  # noqa: E402
from unirl.core.progress.bars import MicrobatchProgress  # noqa: E402

VOCAB = 64
HF_CONFIG = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
# (prompt length, response length); the 3rd has a one-token response.
SHAPES = [(2, 4), (3, 5), (2, 1), (4, 6), (1, 3), (2, 2)]
ENTROPY_COEF = 0.01


# -- shared helpers ----------------------------------------------------------------------------


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random llama saved with plain transformers (the reference weights of the tests)."""
    config = transformers.AutoConfig.for_model(**HF_CONFIG)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def make_sequences(seed: int, shapes=SHAPES) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per sequence."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (p + r,), generator=g).tolist(), p) for p, r in shapes]


def pack(seqs: list[tuple[list[int], int]]) -> TrainMicrobatch:
    """A packed microbatch built by plain loops: target t = token t+1 of the same sequence, mask 1
    where that target is a response token, 0 at each sequence's last position."""
    tokens, positions, targets, mask, seq_ids, cu, counts = [], [], [], [], [], [0], []
    for i, (ids, prompt) in enumerate(seqs):
        for t in range(len(ids)):
            tokens.append(ids[t])
            positions.append(t)
            seq_ids.append(i)
            last = t == len(ids) - 1
            targets.append(0 if last else ids[t + 1])
            mask.append(0.0 if last or t + 1 < prompt else 1.0)
        cu.append(cu[-1] + len(ids))
        counts.append(len(ids) - prompt)
    return TrainMicrobatch(
        sample_indices=tuple(range(len(seqs))),
        tokens=torch.tensor(tokens, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(mask),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long),
        seq_token_counts=torch.tensor(counts, dtype=torch.long),
    )


def empty_microbatch() -> TrainMicrobatch:
    none = torch.zeros(0, dtype=torch.long)
    return TrainMicrobatch(
        sample_indices=(),
        tokens=none,
        position_ids=none,
        cu_seqlens=torch.zeros(1, dtype=torch.int32),
        targets=none,
        loss_mask=torch.zeros(0),
        seq_ids=none,
        seq_token_counts=none,
    )


def make_loss_fn(global_tokens: int):
    """Token-mean NLL minus an entropy bonus, normalised by the step's global token count."""

    def loss_fn(mb, logprobs, entropy):
        nll = -(logprobs * mb.loss_mask).sum()
        ent = (entropy * mb.loss_mask).sum()
        loss = (nll - ENTROPY_COEF * ent) / global_tokens
        return loss, {
            "nll": Metric(numerator=nll.detach(), denominator=mb.loss_mask.sum(), kind="tokens")
        }

    return loss_fn


def num_response_tokens(seqs) -> int:
    return sum(len(ids) - prompt for ids, prompt in seqs)


def make_config(path: Path, **over) -> UnirlConfig:
    # warmup: the first step runs at lr = 2e-2 * 1/2 = 1e-2, set by the schedule, not by AdamW's
    # constructor lr; the references use 1e-2
    opt = dict(lr=2e-2, warmup_steps=2, grad_clip=0.5, weight_decay=0.1)
    opt.update(over.pop("optimizer", {}))
    model = dict(path=str(path))
    model.update(over.pop("model", {}))
    return UnirlConfig(
        model=ModelConfig(**model),
        optimizer=OptimizerConfig(**opt),
        batch=BatchConfig(
            prompts_per_rollout=2,
            samples_per_prompt=2,
            samples_per_optimizer_step=4,
            micro_batch_size=2,
        ),
        parallel=ParallelConfig(zero_stage=over.pop("stage", 0)),
        progress=ProgressConfig(enabled=False),
        **over,
    )


def reference_logprobs(model, seqs) -> list[torch.Tensor]:
    """Per sequence, log p(token t+1 | tokens <= t) for t < len-1, from a plain forward."""
    out = []
    for ids, _ in seqs:
        x = torch.tensor(ids)[None]
        logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        out.append(logp[:-1].gather(-1, x[0, 1:, None])[:, 0])
    return out


def reference_step(folder: Path, seqs, *, lr: float, clip: float, weight_decay: float):
    """The plain-PyTorch step on the full batch: returns (grad norm before clipping, new params)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    n = num_response_tokens(seqs)
    total = 0.0
    for ids, prompt in seqs:
        x = torch.tensor(ids)[None]
        logp_all = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        logp = logp_all[:-1].gather(-1, x[0, 1:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)[:-1]
        valid = torch.tensor([1.0 if t + 1 >= prompt else 0.0 for t in range(len(ids) - 1)])
        total = total + (-(logp * valid).sum() - ENTROPY_COEF * (entropy * valid).sum()) / n
    total.backward()
    params = list(model.parameters())
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    torch.nn.utils.clip_grad_norm_(params, clip)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    opt.step()
    return norm, {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_logprobs_match(flat: torch.Tensor, expected: list[torch.Tensor], seqs, atol: float):
    """`flat` is the packed ``[T]`` output; the last position of each sequence predicts nothing,
    so the len-1 others are compared with the per-sequence references."""
    start = 0
    for (ids, _), exp in zip(seqs, expected):
        torch.testing.assert_close(flat[start : start + len(ids) - 1], exp, atol=atol, rtol=0)
        start += len(ids)
    assert start == flat.numel()


def full_params(backend) -> dict[str, torch.Tensor]:
    """The policy's parameters, gathered under ZeRO-3."""
    import deepspeed

    module = backend.model
    params = list(module.parameters())
    if backend.engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone() for k, v in module.named_parameters()}
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def bar(backend, n: int) -> MicrobatchProgress:
    return MicrobatchProgress("test", n, backend.topology, enabled=False)


def train_step(backend, mbs, global_tokens: int, *, loss_in_head: bool = False):
    spec = LogprobSpec(with_entropy=True, entropy_grad=True, loss_in_head=loss_in_head)
    with bar(backend, len(mbs)) as progress:
        metrics = backend.forward_backward(
            mbs,
            loss_fn=make_loss_fn(global_tokens),
            spec=spec,
            progress=progress,
        )
        assert progress.count == len(mbs)
    return metrics, backend.optimizer_step()


# -- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine run several times faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_forward_logprobs_match_per_sequence_transformers(tiny_folder):
    from unirl.backends.deepspeed import build_backend

    seqs = make_sequences(1)
    backend = build_backend(make_config(tiny_folder, stage=0), total_optimizer_steps=1)
    try:
        assert isinstance(backend, TrainingBackend)
        assert backend.vocab_size == VOCAB
        assert backend.loss_scale(2) == 1.0  # dp = 1: DeepSpeed's mean over ranks divides by 1
        mbs = [pack(seqs[:4]), pack(seqs[4:])]
        with bar(backend, 2) as progress:
            got = backend.forward_logprobs(
                mbs, role="policy", spec=LogprobSpec(), progress=progress
            )
            assert progress.count == 2
        assert backend.forward_calls == {"policy": 2, "reference": 0}
        assert backend._reference is None  # the reference is built only when first asked for
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            expected = reference_logprobs(ref_model, seqs)
        assert_logprobs_match(torch.cat(got), expected, seqs, atol=1e-5)
        assert all(lp.dtype == torch.float32 and not lp.requires_grad for lp in got)
    finally:
        backend.close()


def test_close_removes_the_launcher_variables_it_set(tiny_folder, monkeypatch):
    """Without a launcher the backend sets RANK / WORLD_SIZE / LOCAL_RANK for DeepSpeed; left
    behind after close(), they made accelerate (TRL) in the same process expect a launcher's
    MASTER_ADDR and fail."""
    from unirl.backends.deepspeed import build_backend

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    backend = build_backend(make_config(tiny_folder, stage=0), total_optimizer_steps=1)
    assert {name: os.environ.get(name) for name in names} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    backend.close()
    assert [name for name in names if name in os.environ] == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_matches_plain_pytorch(tiny_folder, stage):
    """Two microbatches plus an empty one (a rank with no tokens) accumulate into exactly the
    gradient of the summed loss; clipping (norm ~1 > 0.5), AdamW with decay on matrices only.
    ZeRO 2 and 3 run with gradient checkpointing on (recomputed activations, same gradients)."""
    from unirl.backends.deepspeed import build_backend

    seqs = make_sequences(2)
    cfg = make_config(tiny_folder, stage=stage, model={"gradient_checkpointing": stage >= 2})
    backend = build_backend(cfg, total_optimizer_steps=3)
    try:
        n = num_response_tokens(seqs)
        mbs = [pack(seqs[:3]), empty_microbatch(), pack(seqs[3:])]
        metrics, stats = train_step(backend, mbs, n)
        norm, expected = reference_step(tiny_folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
        assert norm > 0.5  # clipping is active
        assert stats.grad_norm == pytest.approx(norm, rel=1e-5)
        assert stats.lr == pytest.approx(1e-2) and not stats.skipped
        got = full_params(backend)
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=2e-6, rtol=1e-5, msg=name)
        # the weight sync: every HF key, on the CPU, the updated weights (gathered under ZeRO-3)
        synced = backend.hf_state_dict()
        plain_keys = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder).state_dict()
        assert synced.keys() == plain_keys.keys()
        for name, value in expected.items():
            assert synced[name].device.type == "cpu"
            torch.testing.assert_close(synced[name], value, atol=2e-6, rtol=1e-5, msg=name)
        assert len(metrics) == 3 and float(metrics[1]["nll"].denominator) == 0.0
        assert backend.model.is_gradient_checkpointing == (stage >= 2)
    finally:
        backend.close()


def test_bf16_step_close_to_fp32_reference(tiny_folder):
    """bf16 weights with fp32 master weights (DeepSpeed's bf16 optimizer): log-probs and the
    gradient norm agree with the fp32 reference to bf16 precision."""
    from unirl.backends.deepspeed import build_backend

    seqs = make_sequences(3)
    cfg = make_config(tiny_folder, stage=0, model={"dtype": "bf16"})
    backend = build_backend(cfg, total_optimizer_steps=2)
    try:
        assert next(backend.model.parameters()).dtype == torch.bfloat16
        with bar(backend, 1) as progress:
            (got,) = backend.forward_logprobs(
                [pack(seqs)], role="policy", spec=LogprobSpec(), progress=progress
            )
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            expected = reference_logprobs(ref_model, seqs)
        assert_logprobs_match(got, expected, seqs, atol=0.05)
        _, stats = train_step(backend, [pack(seqs)], num_response_tokens(seqs))
        norm, _ = reference_step(tiny_folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
        assert stats.grad_norm == pytest.approx(norm, rel=0.03)
    finally:
        backend.close()


def _run_steps(backend, steps: range, record: list) -> None:
    """Optimizer steps whose data come from the global torch RNG (so the resumed run also needs
    the RNG state restored to see the same data)."""
    for _ in steps:
        seqs = make_sequences(int(torch.randint(0, 2**31 - 1, (1,))))
        metrics, stats = train_step(
            backend, [pack(seqs[:3]), pack(seqs[3:])], num_response_tokens(seqs)
        )
        record.append((stats.lr, stats.grad_norm, [float(m["nll"].numerator) for m in metrics]))


def test_lr_schedule_resume_bit_exact_and_hf_export(tiny_folder, tmp_path):
    """ZeRO-3: warmup + cosine LR values; save at step 2 of 4, continue to 4; a fresh backend loaded
    from step 2 continues to identical losses, norms and weights; the HF export at the end
    loads with plain transformers and gives the backend's log-probs."""
    from unirl.backends.deepspeed import build_backend

    optimizer = dict(lr=0.1, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    cfg = make_config(tiny_folder, stage=3, optimizer=optimizer)
    torch.manual_seed(7)
    first = build_backend(cfg, total_optimizer_steps=5)
    record: list = []
    try:
        _run_steps(first, range(2), record)
        first.save_checkpoint(tmp_path / "ckpt", {"step": 2, "config": cfg.to_dict()})
        _run_steps(first, range(2), record)
        final = full_params(first)
    finally:
        first.close()
    # lr = 0.1 * m(s), warmup W=2, N=5, r=0.1 (unirl.core.run.lr_schedule):
    # s=0: 1/2 -> 0.05; s=1: 2/2 -> 0.1; s=2: p=(2-2)/(5-2)=0 -> 0.1;
    # s=3: p=1/3 -> 0.1 * (0.1 + 0.9 * (1 + cos(pi/3)) / 2) = 0.1 * (0.1 + 0.45 * 1.5) = 0.0775
    assert [r[0] for r in record] == pytest.approx([0.05, 0.1, 0.1, 0.0775], abs=1e-9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .partial left behind

    torch.manual_seed(12345)  # a different stream: the checkpoint must restore it
    second = build_backend(cfg, total_optimizer_steps=5)
    resumed: list = []
    try:
        client = second.load_checkpoint(tmp_path / "ckpt")
        assert client == {"step": 2, "config": cfg.to_dict()}
        _run_steps(second, range(2), resumed)
        assert resumed == record[2:]  # bit-exact losses, norms and learning rates
        got = full_params(second)
        for name, value in final.items():
            assert torch.equal(got[name], value), name

        second.export_hf(tmp_path / "hf")
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        seqs = make_sequences(9)
        with bar(second, 1) as progress:
            (lp,) = second.forward_logprobs(
                [pack(seqs)], role="policy", spec=LogprobSpec(), progress=progress
            )
        with torch.no_grad():
            expected = reference_logprobs(exported, seqs)
        assert_logprobs_match(lp, expected, seqs, atol=1e-5)
        assert (tmp_path / "hf" / "model.safetensors").is_file()
        assert exported.config.use_cache  # exported for generation

        # The reference under ZeRO-3: a sharded inference engine holding the initial weights.
        with bar(second, 1) as progress:
            (ref,) = second.forward_logprobs(
                [pack(seqs)], role="reference", spec=LogprobSpec(), progress=progress
            )
        assert type(second._reference.module).__name__ == "DeepSpeedEngine"
        initial = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            assert_logprobs_match(ref, reference_logprobs(initial, seqs), seqs, atol=1e-5)
    finally:
        second.close()


def test_reference_is_the_initial_policy_and_frozen(tiny_folder, tmp_path):
    """After a step moves the policy, the (lazily built) reference still gives the initial
    weights' log-probs; a checkpoint without its marker is refused."""
    from unirl.backends.deepspeed import build_backend

    seqs = make_sequences(4)
    backend = build_backend(make_config(tiny_folder, stage=0), total_optimizer_steps=2)
    try:
        train_step(backend, [pack(seqs)], num_response_tokens(seqs))
        with bar(backend, 1) as progress:
            (ref,) = backend.forward_logprobs(
                [pack(seqs)], role="reference", spec=LogprobSpec(), progress=progress
            )
        with bar(backend, 1) as progress:
            (pol,) = backend.forward_logprobs(
                [pack(seqs)], role="policy", spec=LogprobSpec(), progress=progress
            )
        assert backend.forward_calls == {"policy": 2, "reference": 1}
        initial = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            expected = reference_logprobs(initial, seqs)
        assert_logprobs_match(ref, expected, seqs, atol=1e-5)
        assert (pol - ref).abs().max() > 1e-3  # the policy did move
        assert not any(p.requires_grad for p in backend._reference.module.parameters())
        (tmp_path / "half_written").mkdir()  # a crash before the marker
        with pytest.raises(ConfigError, match="has no 'complete' marker"):
            backend.load_checkpoint(tmp_path / "half_written")
        with pytest.raises(ConfigError, match="does not exist"):
            backend.load_checkpoint(tmp_path / "never_written")
    finally:
        backend.close()
