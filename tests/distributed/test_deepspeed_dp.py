"""DeepSpeed backend on 2 gloo processes: one optimizer step with the batch split across the ranks
equals the single-process full-batch step of plain PyTorch (gradient norm before clipping and
updated weights), for ZeRO 0, 1, 2 and 3. That checks `loss_scale = dp`: the losses are normalised
by the global token count, DeepSpeed averages gradients over the 2 ranks, and the factor 2 turns
the average back into the gradient of the summed loss. Rank 1 holds an empty microbatch (a rank
without tokens under a token budget) and must still join every ZeRO collective.

The same spawn checks the op-build lock: both ranks take it at once and hold it in turn, and
both construct DeepSpeed backends at the same moment without failing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from tests.hf_reference import (
    empty_microbatch,
    full_params,
    make_config,
    make_sequences,
    num_response_tokens,
    pack,
    reference_step,
    save_tiny_model,
    train_step,
)
from tests.spawn import run_distributed

STAGES = (0, 1, 2, 3)
LOCK_HOLD_S = 0.3


def _worker(rank: int, world_size: int, folder: str, lock_root: str) -> dict:
    from unirl.backends.deepspeed import build_backend
    from unirl.backends.deepspeed.distributed import op_build_lock

    dist.barrier()
    with op_build_lock(Path(lock_root)):
        start = time.monotonic()  # CLOCK_MONOTONIC is system-wide on Linux: comparable across ranks
        time.sleep(LOCK_HOLD_S)
        held = (start, time.monotonic())

    seqs = make_sequences(11)
    n = num_response_tokens(seqs)  # the global count: both ranks' tokens
    mine = [pack(seqs[:2]), pack(seqs[2:3])] if rank == 0 else [pack(seqs[3:]), empty_microbatch()]
    out = {"held": held}
    for stage in STAGES:
        dist.barrier()  # both ranks build their engines at the same moment
        backend = build_backend(make_config(Path(folder), stage=stage), total_optimizer_steps=2)
        try:
            topo = backend.topology
            assert (topo.dp_size, topo.dp_rank, topo.world_size) == (2, rank, 2)
            assert topo.groups.dp is not None and topo.groups.dp_cp is topo.groups.dp
            _, stats = train_step(backend, mine, n)
            out[stage] = (backend.loss_scale(n), stats.grad_norm, stats.lr, full_params(backend))
            out[f"sync {stage}"] = backend.hf_state_dict()  # collective under ZeRO-3
        finally:
            backend.close()
    assert dist.is_initialized()  # the harness's process group is not the backend's to destroy
    return out


def test_two_ranks_equal_full_batch_reference(tmp_path):
    folder = save_tiny_model(tmp_path / "tiny")
    results = run_distributed(_worker, 2, str(folder), str(tmp_path / "locks"))

    (a0, a1), (b0, b1) = results[0]["held"], results[1]["held"]
    assert a1 <= b0 or b1 <= a0, "both ranks held the op-build lock at once"

    norm, expected = reference_step(folder, make_sequences(11), lr=1e-2, clip=0.5, weight_decay=0.1)
    assert norm > 0.5  # clipping is active
    for stage in STAGES:
        for rank in range(2):
            scale, grad_norm, lr, params = results[rank][stage]
            assert scale == 2.0
            assert grad_norm == pytest.approx(norm, rel=1e-5), (stage, rank)
            assert lr == pytest.approx(1e-2)
            synced = results[rank][f"sync {stage}"]  # full weights on every rank
            for name, value in expected.items():
                msg = f"stage {stage} rank {rank} {name}"
                torch.testing.assert_close(params[name], value, atol=2e-6, rtol=1e-5, msg=msg)
                torch.testing.assert_close(synced[name], value, atol=2e-6, rtol=1e-5, msg=msg)
