"""Fsdp2Backend in one process (world size 1) against plain transformers / PyTorch references
(the helpers of tests/hf_reference.py): per-sequence log-probs, one optimizer step
(gradient norm before clipping, updated weights) with and without CPU offload, bf16 mixed
precision, the LR schedule with bit-exact DCP resume, the HF export round trip, the frozen
reference model. Two-process layouts and Ulysses SP: tests/distributed/test_fsdp2_dp.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf_reference import (  # noqa: E402
    assert_logprobs_match,
    bar,
    empty_microbatch,
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


def fsdp2_config(folder: Path, options: dict | None = None, **over):
    """The DeepSpeed tests' config with ``backend: fsdp2`` and its ``fsdp2:`` section."""
    from unirl.backends.fsdp2.plugin import Fsdp2Options

    return make_config(
        folder, backend="fsdp2", backend_options=Fsdp2Options(**(options or {})), **over
    )


def build(cfg):
    from unirl.backends import build_backend

    return build_backend(cfg, total_optimizer_steps=5)


def forward(backend, seqs, role="policy"):
    with bar(backend, 1) as progress:
        (logp,) = backend.forward_logprobs(
            [pack(seqs)], role=role, spec=LogprobSpec(), progress=progress
        )
    return logp


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "optimizer-offload"])
def test_step_matches_plain_pytorch(tiny_folder, tmp_path, offload):
    """Forward log-probs; two microbatches plus an empty one accumulate into exactly the gradient
    of the summed loss; clipping (norm > 0.5), AdamW with decay on matrices only (its first step,
    also after a checkpoint of the initial state: saving must not start AdamW's step count); the
    weight sync holds the updated weights under every HF key."""
    seqs = make_sequences(2)
    # optimizer.offload: cpu is FSDP2's CPUOffloadPolicy on the policy (fsdp2.cpu_offload's);
    # on the CPU the host copy is the shard itself (no device to move it from)
    optimizer = {"offload": "cpu" if offload else "none"}
    backend = build(fsdp2_config(tiny_folder, optimizer=optimizer))
    try:
        state = backend.policy.module._get_fsdp_state()._fsdp_param_group
        assert (type(state.offload_policy).__name__ == "CPUOffloadPolicy") == offload
        # the host's Adam step: torch's fused CPU kernel
        assert all(bool(g["fused"]) == offload for g in backend.policy.optimizer.param_groups)
        assert isinstance(backend, TrainingBackend)
        assert backend.vocab_size == 64 and backend.loss_scale(3) == 1.0
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            assert_logprobs_match(
                forward(backend, seqs), reference_logprobs(ref_model, seqs), seqs, 1e-5
            )
        backend.save_checkpoint(tmp_path / "init", {})
        mbs = [pack(seqs[:3]), empty_microbatch(), pack(seqs[3:])]
        metrics, stats = train_step(backend, mbs, num_response_tokens(seqs))
        norm, expected = reference_step(tiny_folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
        assert norm > 0.5
        assert stats.grad_norm == pytest.approx(norm, rel=1e-5)
        assert stats.lr == pytest.approx(1e-2) and not stats.skipped
        synced = backend.hf_state_dict()
        assert synced.keys() == ref_model.state_dict().keys()
        for name, value in expected.items():
            assert synced[name].device.type == "cpu"
            torch.testing.assert_close(synced[name], value, atol=2e-6, rtol=1e-5, msg=name)
        assert len(metrics) == 3 and float(metrics[1]["nll"].denominator) == 0.0
        assert backend.forward_calls == {"policy": 4, "reference": 0}
    finally:
        backend.close()


@pytest.mark.parametrize(("grad_reduce", "prefetch"), [("step", 1), ("microbatch", 0)])
def test_gradient_reduction_once_per_step(tiny_folder, monkeypatch, grad_reduce, prefetch):
    """``fsdp2.grad_reduce: step`` reduces each FSDP unit's gradients once per optimizer step
    (after the last microbatch), ``microbatch`` after every microbatch; both give the plain
    PyTorch step on the whole batch. ``fsdp2.prefetch: 1`` (explicit prefetching of the next
    layer) leaves the numbers alike: each layer's forward prefetches the next, its backward the
    one before."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from unirl.backends.fsdp2 import engine

    prefetched: dict[str, list] = {}
    original_prefetch = engine.set_prefetch

    def recorded(layers, depth):
        original_prefetch(layers, depth)
        states = [layer._get_fsdp_state() for layer in layers]
        prefetched["forward"] = [
            [states.index(s) for s in st._states_to_forward_prefetch] for st in states
        ]
        prefetched["backward"] = [
            [states.index(s) for s in st._states_to_backward_prefetch] for st in states
        ]

    monkeypatch.setattr(engine, "set_prefetch", recorded)

    reduces: list[int] = []
    original = _fsdp_param_group.foreach_reduce

    def counted(*args, **kwargs):  # FSDP2's one reduction call per unit and backward
        reduces.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counted)
    seqs = make_sequences(2)
    options = {"grad_reduce": grad_reduce, "prefetch": prefetch}
    backend = build(fsdp2_config(tiny_folder, options))
    try:
        mbs = [pack(seqs[:3]), empty_microbatch(), pack(seqs[3:])]
        _, stats = train_step(backend, mbs, num_response_tokens(seqs))
        layers = transformers.AutoConfig.from_pretrained(tiny_folder).num_hidden_layers
        units = 1 + layers
        assert len(reduces) == units * (1 if grad_reduce == "step" else len(mbs))
        if prefetch:  # the policy and the reference: the same lists
            assert prefetched["forward"] == [[i + 1] for i in range(layers - 1)] + [[]]
            assert prefetched["backward"] == [[]] + [[i] for i in range(layers - 1)]
        else:
            assert not prefetched
        norm, expected = reference_step(tiny_folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-5)
        synced = backend.hf_state_dict()
        for name, value in expected.items():
            torch.testing.assert_close(synced[name], value, atol=2e-6, rtol=1e-5, msg=name)
    finally:
        backend.close()


def test_bf16_mixed_precision(tiny_folder):
    """bf16 compute over fp32 master weights (the sharded parameters stay fp32; FSDP2 casts each
    gathered layer): log-probs and gradient norm agree with fp32 to bf16 precision, the weight
    sync is bf16."""
    seqs = make_sequences(3)
    backend = build(fsdp2_config(tiny_folder, model={"dtype": "bf16"}))
    try:
        assert next(backend.model.parameters()).dtype == torch.float32  # masters
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            assert_logprobs_match(
                forward(backend, seqs), reference_logprobs(ref_model, seqs), seqs, 0.05
            )
        _, stats = train_step(backend, [pack(seqs)], num_response_tokens(seqs))
        norm, _ = reference_step(tiny_folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
        assert stats.grad_norm == pytest.approx(norm, rel=0.03)
        assert all(v.dtype == torch.bfloat16 for v in backend.hf_state_dict().values())
    finally:
        backend.close()


def _run_steps(backend, steps: range, record: list) -> None:
    for _ in steps:
        seqs = make_sequences(int(torch.randint(0, 2**31 - 1, (1,))))
        metrics, stats = train_step(
            backend, [pack(seqs[:3]), pack(seqs[3:])], num_response_tokens(seqs)
        )
        record.append((stats.lr, stats.grad_norm, [float(m["nll"].numerator) for m in metrics]))


def test_lr_schedule_resume_bit_exact_and_hf_export(tiny_folder, tmp_path):
    """Warmup + cosine LR; save at step 2 of 4 (DCP), continue; a fresh backend loaded from
    step 2 continues to identical losses, norms, learning rates and weights; the HF export loads
    with plain transformers and gives the backend's log-probs."""
    optimizer = dict(lr=0.1, lr_schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    cfg = fsdp2_config(tiny_folder, optimizer=optimizer)
    torch.manual_seed(7)
    first = build(cfg)
    record: list = []
    try:
        _run_steps(first, range(2), record)
        first.save_checkpoint(tmp_path / "ckpt", {"step": 2})
        _run_steps(first, range(2), record)
        final = first.hf_state_dict()
    finally:
        first.close()
    # lr = 0.1 * m(s), warmup 2, 5 steps, min ratio 0.1 (as in the DeepSpeed test):
    assert [r[0] for r in record] == pytest.approx([0.05, 0.1, 0.1, 0.0775], abs=1e-9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .partial left behind

    torch.manual_seed(12345)  # a different stream: the checkpoint must restore it
    second = build(cfg)
    resumed: list = []
    try:
        assert second.load_checkpoint(tmp_path / "ckpt") == {"step": 2}
        _run_steps(second, range(2), resumed)
        assert resumed == record[2:]
        got = second.hf_state_dict()
        for name, value in final.items():
            assert torch.equal(got[name], value), name

        second.export_hf(tmp_path / "hf")
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert exported.config.use_cache
        seqs = make_sequences(9)
        with torch.no_grad():
            expected = reference_logprobs(exported, seqs)
        assert_logprobs_match(forward(second, seqs), expected, seqs, 1e-5)
    finally:
        second.close()


def test_reference_is_the_initial_policy_and_frozen(tiny_folder, tmp_path):
    """After a step moves the policy, the (lazily built, sharded, CPU-offloaded) reference still
    gives the initial weights' log-probs; a checkpoint without its marker is refused."""
    seqs = make_sequences(4)
    backend = build(fsdp2_config(tiny_folder, model={"ref_offload": True}))
    try:
        train_step(backend, [pack(seqs)], num_response_tokens(seqs))
        assert backend._reference is None
        ref, pol = forward(backend, seqs, "reference"), forward(backend, seqs, "policy")
        assert backend.forward_calls == {"policy": 2, "reference": 1}
        initial = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            assert_logprobs_match(ref, reference_logprobs(initial, seqs), seqs, 1e-5)
        assert (pol - ref).abs().max() > 1e-3  # the policy did move
        assert not any(p.requires_grad for p in backend._reference.module.parameters())
        (tmp_path / "half_written").mkdir()
        with pytest.raises(ConfigError, match="has no 'complete' marker"):
            backend.load_checkpoint(tmp_path / "half_written")
    finally:
        backend.close()


def test_config_section_and_errors_name_the_key(tiny_folder):
    from unirl.backends.fsdp2.plugin import Fsdp2Options
    from unirl.core.config.run_config import config_from_dict

    base = {
        "backend": "fsdp2",
        "model": {"path": str(tiny_folder)},
        "batch": {"micro_batch_size": 2},
    }
    cfg = config_from_dict({**base, "fsdp2": {"sharding": "hybrid", "shard_size": 2, "sp": 2}})
    assert cfg.backend_options == Fsdp2Options(sharding="hybrid", shard_size=2, sp=2)
    assert cfg.to_dict()["fsdp2"]["sp"] == 2
    with pytest.raises(ConfigError, match=r"fsdp2\.shard_size=2 is only used with"):
        config_from_dict({**base, "fsdp2": {"shard_size": 2}})
    with pytest.raises(ConfigError, match=r"parallel\.cp=2 is not supported with backend: fsdp2"):
        config_from_dict({**base, "parallel": {"cp": 2}})
    with pytest.raises(ConfigError, match=r"parallel\.zero_stage=3 with backend: fsdp2"):
        config_from_dict({**base, "parallel": {"zero_stage": 3}})
    with pytest.raises(ConfigError, match=r"fsdp2\.sp must be >= 1"):
        config_from_dict({**base, "fsdp2": {"sp": 0}})
    with pytest.raises(ConfigError, match=r"fsdp2\.sp=2 does not divide the 3 ranks"):
        Fsdp2Options(sp=2).check_world(3)
