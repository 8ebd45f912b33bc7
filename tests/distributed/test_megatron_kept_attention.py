"""The Megatron backend under ``model.recompute_attention: false`` runs each layer's attention
kernel once per sequence in a training forward + backward, where whole-layer recompute runs it
twice: counted at the aten level over gloo (one process, and TP 2 with sequence parallel), the
expected counts by hand (layers x sequences of the pack; the CPU path calls the kernel per
sequence). Its numbers against the reference: the contract layout ``recompute-kept-attention``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.attention_calls import AttentionCalls
from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH, TINY_LLAMA

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)

LAYERS = 3
LENGTHS = (5, 3, 8)  # 16 tokens: no padding segment under sequence parallel (a multiple of tp)


def _microbatch():
    from unirl.core.data.microbatch import TrainMicrobatch

    n = sum(LENGTHS)
    tokens = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return TrainMicrobatch(
        sample_indices=tuple(range(len(LENGTHS))),
        tokens=tokens,
        position_ids=torch.cat([torch.arange(k) for k in LENGTHS]),
        cu_seqlens=cu,
        targets=torch.roll(tokens, -1),
        loss_mask=torch.ones(n),
        seq_ids=torch.cat([torch.full((k,), i) for i, k in enumerate(LENGTHS)]),
        seq_token_counts=torch.tensor(LENGTHS),
    )


def _loss_fn(mb, logprobs, entropy, /, **_):
    return (mb.loss_mask * logprobs).sum(), {}


def _worker(rank, world_size, recompute_attention, parallel, attention="packed"):
    from unirl.backends.megatron import build_backend
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.errors import ConfigError
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress

    data = {
        "backend": "megatron",
        "model": {
            "hf_config": {**TINY_LLAMA, "num_hidden_layers": LAYERS, "vocab_size": 64},
            "dtype": "fp32",
            "max_seq_len": 16,
            "gradient_checkpointing": True,
            "recompute_attention": recompute_attention,
        },
        "megatron": {"attention": attention},
        "batch": dict(TINY_BATCH),
        "parallel": parallel,
        "logging": {"tensorboard": False},
    }
    cfg = config_from_dict(data, world_size=world_size)
    try:
        backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
    except ConfigError as err:
        return str(err)
    spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size)
    counter = AttentionCalls()
    with counter, MicrobatchProgress("test", 1, backend.topology, enabled=False) as bar:
        backend.forward_backward([_microbatch()], loss_fn=_loss_fn, spec=spec, progress=bar)
    backend.close()
    return counter.forward


@pytest.mark.parametrize(
    "parallel", [{}, {"tp": 2, "sequence_parallel": True}], ids=["tp1", "tp2-sp"]
)
def test_attention_runs_once_per_layer_and_sequence(parallel):
    ranks = 2 if parallel else 1
    kept = run_distributed(_worker, ranks, False, parallel)
    whole = run_distributed(_worker, ranks, True, parallel)
    assert kept == [LAYERS * len(LENGTHS)] * ranks
    assert whole == [2 * LAYERS * len(LENGTHS)] * ranks


def test_an_attention_that_keeps_nothing_is_refused_at_build():
    """megatron.attention: unfused (matmuls and a softmax, no attention kernel) would keep
    nothing: refused naming the key, not run as whole-layer recompute."""
    [err] = run_distributed(_worker, 1, False, {}, "unfused")
    assert "model.recompute_attention: false keeps the outputs of torch's attention" in err
    assert "megatron.attention: unfused" in err
