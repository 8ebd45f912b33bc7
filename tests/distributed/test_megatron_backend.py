"""The Megatron backend on the CPU, by hand.

- the padded-batch conversion (`unirl.backends.megatron.padded`) against tensors written out by
  hand, and `valid_logits` against a per-sequence loop;
- the schedule arithmetic: the loss factor and the interleaved-schedule group size, by hand;
- the backend at TP=2 over gloo, built from ``model.hf_config`` + ``init_seed``: its weights equal
  a Hugging Face model built independently with the same seed, a packed microbatch run as a
  padded batch through the chunk, and the same microbatches through megatron's schedule
  (`forward_logprobs`, with `unirl.backends.megatron.compat.cpu`), give the HF model's
  per-sequence fp64 log-probs.

Training, the optimizer and checkpoints on every layout: the contract suite (`tests/contract`),
on the CPU over gloo here and on GPUs in `tests/unit/test_megatron_backend_gpu.py`.
"""

import importlib.util
import itertools

import pytest
import torch

from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH, TINY_LLAMA

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

HF_CONFIG = {
    **TINY_LLAMA,
    "vocab_size": 100,  # padded by megatron to 256 at TP=2: the padding must stay invisible
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
}
SEED = 7
TEMPERATURE = 0.8
LOGPROB_ATOL = 1e-4


def _microbatch(lengths, seed=0):
    """A packed TrainMicrobatch of sequences with the given lengths (random tokens)."""
    from unirl.core.data.microbatch import TrainMicrobatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, HF_CONFIG["vocab_size"], (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()])
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) if lengths else cu[:0]
    position_ids = torch.cat([torch.arange(n) for n in lengths]) if lengths else cu[:0]
    targets = tokens.clone()
    for start, n in zip(cu[:-1].tolist(), lengths):  # next token; the last position predicts 0
        targets[start : start + n - 1] = tokens[start + 1 : start + n]
        targets[start + n - 1] = 0
    mask = torch.ones(sum(lengths))
    mask[(cu[1:] - 1).tolist()] = 0.0
    return TrainMicrobatch(
        sample_indices=tuple(range(len(lengths))),
        tokens=tokens,
        position_ids=position_ids,
        cu_seqlens=cu.to(torch.int32),
        targets=targets,
        loss_mask=mask,
        seq_ids=seq_ids,
        seq_token_counts=torch.tensor([n - 1 for n in lengths]),
    )


# --- padded batches, by hand ------------------------------------------------------------------


def test_to_padded_by_hand():
    from unirl.backends.megatron.padded import padded_shape, to_padded

    mb = _microbatch([3, 1, 2])
    t = mb.tokens.tolist()  # packed: [a0 a1 a2 | b0 | c0 c1]
    rows, length = padded_shape([mb, _microbatch([4])])
    assert (rows, length) == (3, 4)  # most sequences: 3; longest: 4
    batch = to_padded(mb, rows, length)
    assert batch.tokens.tolist() == [
        [t[0], t[1], t[2], 0],
        [t[3], 0, 0, 0],
        [t[4], t[5], 0, 0],
    ]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]] * 3
    # real positions row * 4 + column, in packed order: row 0 cols 0-2, row 1 col 0, row 2 cols 0-1
    assert batch.flat_index.tolist() == [0, 1, 2, 4, 8, 9]


def test_to_padded_extra_rows_and_empty_microbatch():
    from unirl.backends.megatron.padded import padded_shape, to_padded

    empty = _microbatch([])
    assert padded_shape([empty]) == (1, 1)  # one row of one pad position still runs
    batch = to_padded(empty, 2, 3)
    assert batch.tokens.tolist() == [[0, 0, 0], [0, 0, 0]]
    assert batch.flat_index.tolist() == []
    with pytest.raises(ValueError, match="does not fit"):
        to_padded(_microbatch([5]), 1, 4)


def test_valid_logits_matches_a_per_sequence_loop():
    from unirl.backends.megatron.padded import to_padded, valid_logits

    mb = _microbatch([3, 1, 2])
    batch = to_padded(mb, 4, 5)
    logits = torch.randn(4, 5, 7)
    expected = torch.cat([logits[0, :3], logits[1, :1], logits[2, :2]])  # logits[row, :len]
    assert torch.equal(valid_logits(logits, batch), expected)


# --- packed streams for the schedule, by hand --------------------------------------------------


def test_schedule_stream_tokens_by_hand():
    from unirl.backends.megatron.packed import schedule_stream_tokens

    mbs = [_microbatch([5, 2, 7]), _microbatch([3])]
    mbs = [mb.with_fields(global_cu_seqlens=mb.cu_seqlens) for mb in mbs]  # unsplit boundaries
    assert schedule_stream_tokens(mbs, 1) == 14  # the longest stream
    # cp=2: every sequence padded to a multiple of 4: 8 + 4 + 8 = 20 (and 4)
    assert schedule_stream_tokens(mbs, 2) == 20
    assert schedule_stream_tokens([_microbatch([])], 1) == 1  # an empty microbatch still runs
    empty = _microbatch([])
    assert schedule_stream_tokens([empty.with_fields(global_cu_seqlens=empty.cu_seqlens)], 2) == 4


def test_packed_batch_padding_sequences_by_hand():
    from unirl.backends.megatron.packed import to_packed_batch

    mb = _microbatch([5, 2, 7])
    batch = to_packed_batch(mb, cp_size=1, cp_rank=0, device="cpu", total_tokens=14 + 600)
    # 600 padding tokens after the real 14, as sequences of at most 256: 256 + 256 + 88
    assert batch.inputs.layout.cu_seqlens.tolist() == [0, 5, 7, 14, 270, 526, 614]
    ids = batch.inputs.input_ids[0].tolist()
    assert ids[:14] == mb.tokens.tolist() and ids[14:] == [0] * 600
    positions = batch.inputs.position_ids[0].tolist()
    assert positions[:14] == [0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 4, 5, 6]
    assert positions[14:270] == list(range(256)) and positions[526:] == list(range(88))
    params = batch.model_kwargs()["packed_seq_params"]
    assert params.qkv_format == "thd" and params.max_seqlen_q == 256
    assert params.cu_seqlens_q.tolist() == [0, 5, 7, 14, 270, 526, 614]
    logits = torch.randn(1, 614, 3)
    assert torch.equal(batch.real_logits(logits), logits[0, :14])
    # megatron's p2p length is the global stream; with nothing to pad, nothing is added
    assert batch.schedule_tokens == 614
    own = to_packed_batch(mb, cp_size=1, cp_rank=0, device="cpu")
    assert own.total_tokens == 14 and own.inputs.layout.num_seqs == 3
    # nothing padded: the logits' gradient flows back through a view, no [1, T, V] copy
    leaf = torch.randn(1, 14, 3, requires_grad=True)
    rows = own.real_logits(leaf)
    assert rows.shape == (14, 3) and rows.grad_fn.name() == "ViewBackward0"
    with pytest.raises(ValueError, match="cannot be padded"):
        to_packed_batch(mb, cp_size=1, cp_rank=0, device="cpu", total_tokens=13)
    # an empty microbatch (a data-parallel rank with no samples left) still runs: one padding
    # sequence of one token (cp=1), read by nobody
    empty = _microbatch([])
    alone = to_packed_batch(empty, cp_size=1, cp_rank=0, device="cpu")
    assert alone.inputs.layout.cu_seqlens.tolist() == [0, 1]
    assert alone.inputs.input_ids.tolist() == [[0]] and alone.real_tokens == 0


def test_packed_batch_padding_under_cp_by_hand():
    from unirl.backends.megatron.packed import to_packed_batch
    from unirl.core.data.context_parallel import CPLayout

    # cp=2, rank 1: sequences of 5 and 3 tokens padded to 8 and 4; then 12 padding tokens
    tokens = torch.arange(10, 18)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32)
    layout = CPLayout.build(cu.long(), 2, 1)
    local = _microbatch([]).with_fields(
        tokens=layout.split(tokens),
        cu_seqlens=layout.local_cu_seqlens.to(torch.int32),
        global_cu_seqlens=cu,
    )
    batch = to_packed_batch(local, cp_size=2, cp_rank=1, device="cpu", total_tokens=24)
    # rank 1 holds chunks 1 and 2 of each sequence (chunk = len / 4): seq 0 positions 2, 3, 4, 5
    # (tokens 12, 13, 14, pad) and seq 1 positions 1, 2 (tokens 16, 17), then its 6 of the pad
    assert batch.inputs.input_ids[0].tolist() == [12, 13, 14, 0, 16, 17, 0, 0, 0, 0, 0, 0]
    assert batch.inputs.position_ids[0].tolist() == [2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.real_tokens == 6 and batch.schedule_tokens == 24


# --- schedule arithmetic, by hand ---------------------------------------------------------------


def test_loss_scale_cancels_megatrons_mean():
    from unirl.backends.megatron.schedule import loss_scale
    from unirl.core.topology import Topology

    # megatron: loss * cp / n, then DDP * 1 / (dp * cp): 4 microbatches, dp 2 -> factor 4 * 2 = 8
    topo = Topology.from_rank(0, 4, tp=2)  # dp = 4 / 2 = 2
    assert loss_scale(4, topo) == 8.0
    assert loss_scale(3, Topology.single_process()) == 3.0


@pytest.mark.parametrize(
    ("microbatches", "pp", "group"),
    [
        (4, 2, 2),  # 4 % 2 == 0: megatron's default group of pp
        (5, 2, 3),  # 5 % 2 = 1 < 2; 5 % 3 = 2 >= 2
        (7, 2, 4),  # 7 % 2 = 1, 7 % 3 = 1, 7 % 4 = 3 >= 2
        (2, 2, 2),
        (5, 4, 5),  # 5 % 4 = 1 < 4; g = M = 5
    ],
)
def test_vpp_group_size_by_hand(microbatches, pp, group):
    from unirl.backends.megatron.schedule import vpp_group_size

    assert vpp_group_size(microbatches, pp) == group


def test_zero_stage_selects_the_distributed_optimizer():
    from unirl.backends.megatron.optimizer import use_distributed_optimizer
    from unirl.core.config.run_config import config_from_dict

    zero1 = _config_dict(1) | {"parallel": {"zero_stage": 1}}
    assert use_distributed_optimizer(config_from_dict(zero1, world_size=1)) is True
    assert use_distributed_optimizer(config_from_dict(_config_dict(1), world_size=1)) is False


# --- the backend at TP=2 over gloo --------------------------------------------------------------


def _config_dict(tp):
    return {
        "backend": "megatron",
        "model": {"hf_config": dict(HF_CONFIG), "init_seed": SEED, "max_seq_len": 16},
        "optimizer": {"lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0},
        "batch": dict(TINY_BATCH),
        "parallel": {"tp": tp},
        "rollout": {"temperature": TEMPERATURE},
        "train": {"seed": 0},
        "logging": {"tensorboard": False},
    }


def _hf_reference():
    """The HF model a seed names, built here with plain transformers, and its weights."""
    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model("llama", **fields)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model


def _hf_logprobs(model, mb):
    """Per packed position, fp64 log p(target) of each sequence run alone (targets of the last
    position of each sequence are masked, so only the first n - 1 positions are compared)."""
    out = []
    cu = mb.cu_seqlens.tolist()
    with torch.no_grad():
        for start, end in itertools.pairwise(cu):
            ids = mb.tokens[start:end][None]
            logits = model(ids).logits[0].double() / TEMPERATURE
            logp = torch.log_softmax(logits, -1).gather(1, mb.targets[start:end, None])[:, 0]
            out.append(logp)
    return torch.cat(out)


def _tp_worker(rank, world_size):
    from unirl.backends.megatron import build_backend
    from unirl.backends.megatron.padded import padded_shape, to_padded, valid_logits
    from unirl.core.backend import token_logprobs
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress

    cfg = config_from_dict(_config_dict(tp=2), world_size=world_size)
    backend = build_backend(cfg, total_optimizer_steps=2, needs_reference=True)
    topo = backend.topology
    out = {"tp_rank": topo.tp_rank, "tp_size": topo.tp_size, "vocab": backend.vocab_size}
    out["state"] = backend.hf_state_dict()

    mbs = [_microbatch([5, 2, 7], seed=1), _microbatch([3], seed=2)]
    rows, length = padded_shape(mbs)
    spec = LogprobSpec(temperature=TEMPERATURE, vocab_size=backend.vocab_size)
    logps = []
    for chunks in (backend.model, backend.reference().chunks):
        per_mb = []
        for mb in mbs:
            batch = to_padded(mb, rows, length)
            with torch.no_grad():
                logits = chunks[0](batch.tokens, batch.position_ids, None)  # [rows, L, V/tp]
            logp, _ = token_logprobs(
                valid_logits(logits, batch), mb.targets, spec, tp_group=topo.groups.tp
            )
            per_mb.append(logp)
        logps.append(per_mb)
    out["logprobs"], out["ref_logprobs"] = logps

    # the same microbatches through megatron's schedule (gloo, `cpu_compat`)
    with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
        out["scheduled"] = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)
    out["forward_calls"] = dict(backend.forward_calls)
    backend.close()
    return out


def test_backend_on_cpu_tp2():
    results = run_distributed(_tp_worker, 2)
    hf = _hf_reference()
    expected_state = hf.state_dict()
    mbs = [_microbatch([5, 2, 7], seed=1), _microbatch([3], seed=2)]
    expected = [_hf_logprobs(hf, mb) for mb in mbs]
    assert sorted(r["tp_rank"] for r in results) == [0, 1]
    for r in results:
        assert r["tp_size"] == 2 and r["vocab"] == HF_CONFIG["vocab_size"]
        # the same seed names the same weights as a plain transformers build
        assert set(r["state"]) == set(expected_state)
        for name, tensor in expected_state.items():
            assert torch.equal(r["state"][name], tensor), name
        for got_mbs in (r["logprobs"], r["ref_logprobs"]):
            for mb, got, want in zip(mbs, got_mbs, expected):
                valid = mb.loss_mask.bool()  # the last position of each sequence predicts nothing
                assert got.shape == want.shape
                torch.testing.assert_close(
                    got.double()[valid], want[valid], atol=LOGPROB_ATOL, rtol=0
                )
        for mb, got, want in zip(mbs, r["scheduled"], expected):
            valid = mb.loss_mask.bool()
            torch.testing.assert_close(got.double()[valid], want[valid], atol=LOGPROB_ATOL, rtol=0)
        # one model forward per microbatch, counted by the schedule's forward step
        assert r["forward_calls"] == {"policy": len(mbs), "reference": 0}
