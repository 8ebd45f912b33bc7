"""The Megatron GPTModel on packed (THD) sequences through unirl's packed attention, with and
without context parallel, on the CPU: per-token log-probs equal the Hugging Face model's, run on
each sequence alone, and the CP=2 gradients summed over the CP ranks equal the CP=1 gradients,
which equal the HF model's own gradients.

One packed stream of four sequences of 7, 1, 3 and 6 tokens (with cp=2 each is padded to a
multiple of 4: the 1- and 3-token sequences are shorter than ``2*cp``, so a CP rank holds only
padding of some of them). A tiny Llama (hidden 64, 2 layers, 4 query heads over 2 key/value heads,
vocabulary 100 that Megatron pads to 128), every parameter random, fp32.
"""

import importlib.util

import pytest
import torch

from tests.spawn import run_distributed
from tests.tiny_models import MEGATRON_DIMS, noisy_hf_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

VOCAB = 100
LENGTHS = [7, 1, 3, 6]
LOGPROB_ATOL = 1e-4
GRAD_ATOL = 1e-5


def _config():
    return transformers.LlamaConfig(
        **MEGATRON_DIMS,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        rope_parameters={"rope_theta": 500.0},  # a small base: wrong positions show clearly
    )


def _stream():
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return tokens, cu


def _hf_reference(model, tokens, cu):
    """Each sequence through the HF model alone: ``logp[t] = log_softmax(logits[t])[ids[t+1]]``
    (fp64) at every position with a next token, and the HF gradient of their sum."""
    model.zero_grad()
    logp, valid = torch.zeros(tokens.numel(), dtype=torch.float64), torch.zeros(tokens.numel())
    total = 0.0
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b - a < 2:
            continue  # a 1-token sequence predicts nothing
        ids = tokens[a:b][None]
        logits = model(ids).logits[0, :-1]
        seq = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        total = total + seq.sum()
        with torch.no_grad():
            logp[a : b - 1] = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, 1:, None])[
                :, 0
            ]
        valid[a : b - 1] = 1
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp, valid.bool(), grads


# --- worker side ------------------------------------------------------------------------------


def _microbatch(tokens, cu, cp, rank):
    """A `TrainMicrobatch` as `build_microbatch` lays it out (tokens CP-local)."""
    from unirl.core.data.context_parallel import CPLayout, shift_to_next_token
    from unirl.core.data.microbatch import TrainMicrobatch

    cu64 = cu.long()
    layout = CPLayout.build(cu64, cp, rank)
    targets = shift_to_next_token(tokens, cu64)
    mask = shift_to_next_token(torch.ones(tokens.numel()), cu64, fill=0.0)
    return TrainMicrobatch(
        sample_indices=tuple(range(len(LENGTHS))),
        tokens=layout.split(tokens),
        position_ids=layout.position_ids,
        cu_seqlens=layout.local_cu_seqlens.to(torch.int32),
        targets=layout.split(targets),
        loss_mask=layout.split(mask),
        seq_ids=layout.seq_ids,
        seq_token_counts=torch.tensor([n - 1 if n else 0 for n in LENGTHS]),
        global_cu_seqlens=cu,
    )


def _thd_rope_positions(layout):
    """The positions megatron's THD RoPE gives this rank's tokens: its frequency table replaced
    by the positions themselves, sliced exactly as `_apply_rotary_pos_emb_thd` slices it."""
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    padded = layout.cu_seqlens_padded
    table = torch.arange(int((padded[1:] - padded[:-1]).max()))
    pieces = torch.split(
        torch.zeros(int(padded[-1]) // layout.cp_size),
        ((padded[1:] - padded[:-1]) // layout.cp_size).tolist(),
    )
    return torch.cat(
        [_get_thd_freqs_on_this_cp_rank(layout.cp_rank, layout.cp_size, x, table) for x in pieces]
    )


def _run(cp, world, state, tokens, cu, tp=1):
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.packed import PAD_PIECE, packed_model_inputs, to_packed_batch
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_layout import export_hf_state_dict, load_hf_weights
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.maths.logprobs import logprobs_from_logits

    parallel = ParallelConfig(tp=tp, cp=cp, world_size=world)
    initialize_parallel_state(parallel)
    topo = topology_from_parallel_state()
    (model,) = build_model_chunks(_config(), parallel, dtype=torch.float32)
    load_hf_weights([model], state, _config(), topo)
    tp_group = topo.groups.tp if tp > 1 else None
    mb = _microbatch(tokens, cu, topo.cp_size, topo.cp_rank)
    inputs = packed_model_inputs(mb, cp_size=topo.cp_size, cp_rank=topo.cp_rank, device="cpu")
    # the same microbatch padded to a longer stream, as a pipeline schedule call pads it: more
    # than two padding sequences after the real ones
    own = int(inputs.layout.cu_seqlens_padded[-1])
    padded = to_packed_batch(
        mb, cp_size=cp, cp_rank=topo.cp_rank, device="cpu", total_tokens=own + 2 * PAD_PIECE + 4
    )
    with torch.no_grad():
        padded_logits = model(**padded.model_kwargs())
        padded_logp = logprobs_from_logits(
            padded.real_logits(padded_logits), mb.targets, tp_group=tp_group, vocab_size=VOCAB
        )
    # a microbatch without tokens (a data-parallel rank with no samples left) still runs
    empty = mb.with_fields(
        tokens=mb.tokens[:0], cu_seqlens=cu[:1], global_cu_seqlens=cu[:1], targets=mb.targets[:0]
    )
    empty_batch = to_packed_batch(empty, cp_size=cp, cp_rank=topo.cp_rank, device="cpu")
    with torch.no_grad():
        empty_logits = model(**empty_batch.model_kwargs())
    assert empty_batch.real_logits(empty_logits).shape[0] == 0
    logits = model(
        inputs.input_ids, inputs.position_ids, None, packed_seq_params=inputs.packed_seq_params
    )
    assert logits.shape[:2] == (1, mb.num_tokens)
    logp = logprobs_from_logits(logits[0], mb.targets, tp_group=tp_group, vocab_size=VOCAB)
    (logp * mb.loss_mask).sum().backward()
    # the objective is the sum over CP ranks: sum each parameter's gradient over them
    grads = [p.grad for p in model.parameters()]
    if topo.cp_size > 1:
        for g in grads:
            torch.distributed.all_reduce(g, group=topo.groups.cp)
    with torch.no_grad():  # HF layout of the gradients: the export is a reshuffle of tensors
        for p in model.parameters():
            p.copy_(p.grad)
    out = {
        "pad_sequences": padded.inputs.layout.num_seqs - len(LENGTHS),
        "padded_input_tokens": padded.inputs.input_ids.shape[1],
        "padded_logp": inputs.layout.gather(padded_logp, topo.groups.cp if cp > 1 else None),
        "logp": inputs.layout.gather(logp.detach(), topo.groups.cp if cp > 1 else None),
        "grads": export_hf_state_dict([model], _config(), topo),
        "rope_positions": _thd_rope_positions(inputs.layout),
        "layout_positions": inputs.layout.position_ids,
    }
    ps.destroy_model_parallel()
    return out


def _two_ranks(rank, world, state, tokens, cu):
    # one spawn for both layouts: CP=1 (run on both ranks as dp=2) then CP=2
    return {"cp1": _run(1, world, state, tokens, cu), "cp2": _run(2, world, state, tokens, cu)}


# --- checks -----------------------------------------------------------------------------------


def test_packed_forward_and_cp_gradients_match_hf():
    model = noisy_hf_model(_config(), 3)
    tokens, cu = _stream()
    ref_logp, valid, ref_grads = _hf_reference(model, tokens, cu)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    per_rank = run_distributed(_two_ranks, 2, state, tokens, cu)

    # megatron's THD RoPE picks CPLayout's global positions; cp=2 rank 0 of the 7-token
    # sequence (padded to 8, chunks of 2): positions 0, 1, 6, 7
    for rank in range(2):
        for name in ("cp1", "cp2"):
            res = per_rank[rank][name]
            assert torch.equal(res["rope_positions"], res["layout_positions"]), (rank, name)
    assert per_rank[0]["cp2"]["layout_positions"][:4].tolist() == [0, 1, 6, 7]

    for rank in range(2):
        for name in ("cp1", "cp2"):
            for key in ("logp", "padded_logp"):
                got = per_rank[rank][name][key]
                assert got.shape == (sum(LENGTHS),)
                torch.testing.assert_close(
                    got.double()[valid],
                    ref_logp[valid],
                    atol=LOGPROB_ATOL,
                    rtol=0,
                    msg=f"rank {rank} {name} {key}",
                )
    # padding: 2 * 256 + 4 tokens after the real stream, as 3 sequences, split over the CP ranks
    real = {"cp1": sum(LENGTHS), "cp2": sum(-(-n // 4) * 4 for n in LENGTHS)}
    for name, cp in (("cp1", 1), ("cp2", 2)):
        res = per_rank[0][name]
        assert res["pad_sequences"] == 3
        assert res["padded_input_tokens"] == (real[name] + 2 * 256 + 4) // cp
    for key, ref in ref_grads.items():
        cp1 = per_rank[0]["cp1"]["grads"][key]
        torch.testing.assert_close(cp1, ref, atol=GRAD_ATOL, rtol=1e-4, msg=f"cp1 vs hf {key}")
        for rank in range(2):
            cp2 = per_rank[rank]["cp2"]["grads"][key]
            torch.testing.assert_close(cp2, cp1, atol=GRAD_ATOL, rtol=1e-4, msg=f"cp2 {key}")


def _tp2_cp2(rank, world, state, tokens, cu):
    return _run(2, world, state, tokens, cu, tp=2)


def test_tp2_cp2_packed_forward_and_gradients_match_hf():
    """4 ranks, TP=2 x CP=2 (a layout of the 4-GPU contract, scaled down to gloo): the
    vocabulary-parallel log-probs of the packed stream, padded or not, and the gradients equal
    the HF model's."""
    model = noisy_hf_model(_config(), 3)
    tokens, cu = _stream()
    ref_logp, valid, ref_grads = _hf_reference(model, tokens, cu)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    per_rank = run_distributed(_tp2_cp2, 4, state, tokens, cu)
    for rank, res in enumerate(per_rank):
        for key in ("logp", "padded_logp"):
            torch.testing.assert_close(
                res[key].double()[valid],
                ref_logp[valid],
                atol=LOGPROB_ATOL,
                rtol=0,
                msg=f"rank {rank} {key}",
            )
        for name, ref in ref_grads.items():
            torch.testing.assert_close(
                res["grads"][name], ref, atol=GRAD_ATOL, rtol=1e-4, msg=f"rank {rank} {name}"
            )
