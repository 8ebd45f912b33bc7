"""DeepSpeedBackend in one process (world size 1) against plain transformers / PyTorch references
(`tests.hf_reference`, shared with the FSDP2 tests and tests/distributed/test_deepspeed_dp.py):
per-sequence log-probs, one optimizer step under ZeRO 0-3 (gradient norm before clipping, updated
weights), the LR schedule, bit-exact resume, the HF export round trip.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("deepspeed")
transformers = pytest.importorskip("transformers")

from tests.hf_reference import (  # noqa: E402
    VOCAB,
    assert_logprobs_match,
    bar,
    empty_microbatch,
    full_params,
    make_config,
    make_sequences,
    num_response_tokens,
    pack,
    reference_logprobs,
    reference_step,
    train_step,
)
from unirl.core.backend import TrainingBackend  # noqa: E402
from unirl.core.errors import ConfigError  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize(
    ("stage", "offload"), [(0, False), (1, False), (2, False), (3, False), (1, True)]
)
def test_step_matches_plain_pytorch(tiny_folder, stage, offload):
    """Two microbatches plus an empty one (a rank with no tokens) accumulate into exactly the
    gradient of the summed loss; clipping (norm ~1 > 0.5), AdamW with decay on matrices only.
    ZeRO 2 and 3 run with gradient checkpointing on (recomputed activations, same gradients).
    ``optimizer.offload: cpu`` (ZeRO-Offload) takes the same step on the optimizer's host copy."""
    from unirl.backends.deepspeed import build_backend

    seqs = make_sequences(2)
    cfg = make_config(
        tiny_folder,
        stage=stage,
        model={"gradient_checkpointing": stage >= 2},
        optimizer={"offload": "cpu" if offload else "none"},
    )
    backend = build_backend(cfg, total_optimizer_steps=3)
    try:
        zero = backend.policy.engine.config["zero_optimization"]
        assert ("offload_optimizer" in zero) == offload
        # ZeRO's optimizer keeps its fp32 partitions and moments on the host (cpu_offload)
        assert getattr(backend.policy.engine.optimizer, "cpu_offload", False) == offload
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
