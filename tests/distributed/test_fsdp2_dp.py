"""FSDP2 backend on 2 gloo processes against the single-process full-batch step of plain PyTorch
(`tests.hf_reference.reference_step`): gradient norm before clipping and updated
weights, for every way the two ranks can share the work:

- ``full_shard`` / ``shard_grad_op`` / ``hybrid`` (two replicas of one shard) with the batch
  split over the 2 data-parallel ranks, rank 1 holding an empty microbatch;
- Ulysses ``sp=2``: both ranks hold the same microbatches, each split into its half of every
  sequence with core's context-parallel layout; attention exchanges heads for tokens;
- ``full_shard`` and ``sp=2`` with ``model.fused_head`` and the loss inside the head
  (``spec.loss_in_head``): each microbatch with tokens goes through core's ``head_loss``.

Gradients are reduced once per optimizer step (``fsdp2.grad_reduce: step``, the default). Each
checks `loss_scale = world size`: losses are normalised by the global token count, FSDP2
averages gradients over the 2 ranks, the factor 2 makes that average the gradient of the sum.
The forward-only log-probs of the SP layout, gathered over the SP group, must equal the plain
per-sequence transformers log-probs (SP = 2 equals SP = 1).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.hf_reference import (
    empty_microbatch,
    make_config,
    make_sequences,
    num_response_tokens,
    pack,
    reference_logprobs,
    reference_step,
    save_tiny_model,
    train_step,
)
from tests.spawn import run_distributed

# name -> (fsdp2 section, extra model keys); full_shard and sp2 without activation
# checkpointing also run in the contract suite (tests/contract, layouts full-dp2 and sp2)
LAYOUTS = {
    "full_shard": ({}, {}),
    "shard_grad_op+ckpt": ({"sharding": "shard_grad_op"}, {"gradient_checkpointing": True}),
    "hybrid": ({"sharding": "hybrid", "shard_size": 1}, {}),
    "sp2+ckpt": ({"sp": 2}, {"gradient_checkpointing": True}),
    # the loss inside the fused head (spec.loss_in_head): rank 1's empty microbatch takes the
    # head's log-probs path while rank 0 computes the loss in the head (the same collectives)
    "full_shard+fused": ({}, {"fused_head": True}),
    "sp2+fused": ({"sp": 2}, {"fused_head": True}),
}


def split_for_sp(mb, sp: int, rank: int):
    """This SP rank's part of a packed microbatch (core's CP layout), global sequence counts."""
    from unirl.core.data.context_parallel import CPLayout

    lay = CPLayout.build(mb.cu_seqlens.long(), sp, rank)
    return mb.with_fields(
        tokens=lay.split(mb.tokens),
        position_ids=lay.position_ids,
        cu_seqlens=lay.local_cu_seqlens.to(torch.int32),
        targets=lay.split(mb.targets),
        loss_mask=lay.split(mb.loss_mask),
        seq_ids=lay.seq_ids,
        global_cu_seqlens=mb.cu_seqlens,
    )


def _worker(rank: int, world_size: int, folder: str) -> dict:
    from unirl.backends import build_backend
    from unirl.backends.fsdp2.plugin import Fsdp2Options
    from unirl.core import backend as core_backend
    from unirl.core.config.derived import fused_head
    from unirl.core.data.context_parallel import gather_from_cp
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress

    in_head: list[int] = []  # core's head_loss calls (the loss inside the fused head)
    original = core_backend.head_loss

    def counted(*args, **kwargs):
        in_head.append(1)
        return original(*args, **kwargs)

    core_backend.head_loss = counted
    seqs = make_sequences(11)
    n = num_response_tokens(seqs)  # the global count: both ranks' tokens
    out = {}
    for name, (section, model) in LAYOUTS.items():
        fsdp = Fsdp2Options(**section)
        cfg = make_config(Path(folder), model=model, backend="fsdp2", backend_options=fsdp)
        backend = build_backend(cfg, total_optimizer_steps=2)
        try:
            topo = backend.topology
            if fsdp.sp > 1:
                assert (topo.cp_size, topo.cp_rank, topo.dp_size) == (2, rank, 1)
                group = topo.groups.cp
                whole = [pack(seqs[:3]), pack(seqs[3:])]
                mine = [split_for_sp(mb, 2, rank) for mb in whole]
                with MicrobatchProgress("t", 2, topo, enabled=False) as bar:
                    logps = backend.forward_logprobs(
                        mine, role="policy", spec=LogprobSpec(), progress=bar
                    )
                out[f"logp {name}"] = torch.cat(
                    [gather_from_cp(lp, mb.cu_seqlens, group) for lp, mb in zip(logps, whole)]
                )
                mine.append(empty_microbatch())
            else:
                assert (topo.dp_size, topo.dp_rank) == (2, rank)
                mine = (
                    [pack(seqs[:2]), pack(seqs[2:3])]
                    if rank == 0
                    else [pack(seqs[3:]), empty_microbatch()]
                )
            calls = len(in_head)
            _, stats = train_step(backend, mine, n, loss_in_head=fused_head(cfg))
            out[f"in-head {name}"] = len(in_head) - calls
            out[name] = (backend.loss_scale(len(mine)), stats.grad_norm, backend.hf_state_dict())
        finally:
            backend.close()
    return out


def test_two_ranks_equal_full_batch_reference(tmp_path):
    import transformers

    folder = save_tiny_model(tmp_path / "tiny")
    results = run_distributed(_worker, 2, str(folder))
    seqs = make_sequences(11)
    norm, expected = reference_step(folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
    assert norm > 0.5  # clipping is active
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logps = reference_logprobs(model, seqs)
    for name in LAYOUTS:
        for rank in range(2):
            scale, grad_norm, synced = results[rank][name]
            assert scale == 2.0
            # microbatches with tokens computed their loss inside the fused head, others not
            with_tokens = 2 if name.startswith("sp2") else (2 if rank == 0 else 1)
            fused = name.endswith("+fused")
            assert results[rank][f"in-head {name}"] == (with_tokens if fused else 0), name
            assert grad_norm == pytest.approx(norm, rel=1e-5), (name, rank)
            for key, value in expected.items():
                msg = f"{name} rank {rank} {key}"
                torch.testing.assert_close(synced[key], value, atol=2e-6, rtol=1e-5, msg=msg)
            if name.startswith("sp2"):
                got = results[rank][f"logp {name}"]
                start = 0
                for (ids, _), exp in zip(seqs, logps):
                    torch.testing.assert_close(
                        got[start : start + len(ids) - 1], exp, atol=1e-5, rtol=0
                    )
                    start += len(ids)
