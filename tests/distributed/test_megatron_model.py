"""The Megatron GPTModel built from a Hugging Face config: HF -> Megatron -> HF is exact in every
parallel layout, the export loads with `from_pretrained`, and the model's per-token log-probs
equal an independent `log_softmax` of the Hugging Face model's logits.

Tiny models (hidden 64, 4 layers, 4 heads, 2 key/value heads, vocabulary 100 so that Megatron
pads it); every HF parameter is drawn at random, norms and biases included, so a misplaced norm,
bias or head would show. Qwen3 has per-head q/k RMSNorm and a head_dim (24) that is not
hidden / heads (16).
"""

import importlib.util
import re

import pytest
import torch

from tests.spawn import run_distributed
from tests.tiny_models import MEGATRON_DIMS, noisy_hf_model

# megatron is imported in the worker processes only (the parent would pay ~10 s for nothing)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

VOCAB = 100
BATCH, SEQ = 2, 11  # B != S: a wrong [S, B] / [B, S] orientation fails
LOGPROB_ATOL = 1e-4
COMMON = dict(**MEGATRON_DIMS, num_hidden_layers=4, vocab_size=VOCAB)


def _configs():
    return {
        "qwen2_tied": transformers.Qwen2Config(
            **COMMON, tie_word_embeddings=True, rope_parameters={"rope_theta": 20000.0}
        ),
        "llama_untied": transformers.LlamaConfig(
            **COMMON, tie_word_embeddings=False, rope_parameters={"rope_theta": 5000.0}
        ),
        "qwen3_tied_head_dim24": transformers.Qwen3Config(
            **COMMON, head_dim=24, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6}
        ),
    }


def _llama3_rope_config():
    return transformers.LlamaConfig(
        **COMMON,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )


def _reference_logprobs(model, ids):
    """log p(ids[:, t+1] | ids[:, :t+1]) from the HF logits, fp64 log_softmax, [B * (S-1)]."""
    with torch.no_grad():
        logits = model(ids).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).reshape(-1)


def _cases(configs, seed=0):
    out = {}
    for i, (name, config) in enumerate(configs.items()):
        model = noisy_hf_model(config, seed + i)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(i))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        out[name] = (config, state, ids, _reference_logprobs(model, ids))
    return out


# --- worker side ------------------------------------------------------------------------------


def _pipeline_logprobs(chunks, topo, ids):
    """Run the chunks in pipeline order by hand (independent of megatron's schedules): stage 0 chunk 0, stage 1
    chunk 0, ..., stage 0 chunk 1, ...; each output is broadcast over the pipeline group."""
    import torch.distributed as dist

    from unirl.core.maths.logprobs import logprobs_from_logits

    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    hidden, out = None, None
    steps = [(vp, stage) for vp in range(topo.virtual_stages) for stage in range(topo.pp_size)]
    for i, (vp, stage) in enumerate(steps):
        if stage == topo.pp_rank:
            chunks[vp].set_input_tensor(hidden)
            with torch.no_grad():
                out = chunks[vp](ids, positions, None)
        if i == len(steps) - 1:
            break
        buf = out if stage == topo.pp_rank else torch.empty(SEQ, BATCH, 64)
        dist.broadcast(buf, src=dist.get_global_rank(topo.groups.pp, stage), group=topo.groups.pp)
        hidden = buf
    if not topo.is_last_pipeline_stage():
        return None
    assert out.shape[:2] == (BATCH, SEQ)  # logits come back batch-first [B, S, V_local]
    logits = out[:, :-1].reshape(-1, out.shape[-1])
    return logprobs_from_logits(
        logits,
        ids[:, 1:].reshape(-1),
        tp_group=topo.groups.tp if topo.tp_size > 1 else None,
        vocab_size=VOCAB,
    )


def _run_layout(tp, pp, vpp, cases, world, save_dir=None):
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.model import build_model_chunks, chunk_layer_numbers
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_layout import (
        export_hf_state_dict,
        load_hf_weights,
        save_hf,
    )
    from unirl.core.config.run_config import ParallelConfig

    parallel = ParallelConfig(tp=tp, pp=pp, vpp=vpp, world_size=world)
    initialize_parallel_state(parallel)
    topo = topology_from_parallel_state()
    results = {}
    for name, (config, source, ids, _) in cases.items():
        chunks = build_model_chunks(config, parallel, dtype=torch.float32)
        load_hf_weights(chunks, source, config, topo)
        results[name] = {
            "pp_rank": topo.pp_rank,
            "layers": [chunk_layer_numbers(c) for c in chunks],
            "local_vocab_rows": [
                tuple(p.shape) for c in chunks for n, p in c.named_parameters() if "word_emb" in n
            ],
            "export": export_hf_state_dict(chunks, config, topo),
            "logprobs": _pipeline_logprobs(chunks, topo, ids),
        }
        if save_dir is not None:
            save_hf(f"{save_dir}/{name}", chunks, config, topo)
    ps.destroy_model_parallel()
    return results


def _eight_layer_chunks(world):
    """HF layer indices of each chunk of an 8-layer model at pp=2, vpp=2 (built, not loaded)."""
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.model import build_model_chunks, chunk_layer_numbers
    from unirl.backends.megatron.topology import initialize_parallel_state
    from unirl.core.config.run_config import ParallelConfig

    parallel = ParallelConfig(pp=2, vpp=2, world_size=world)
    initialize_parallel_state(parallel)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 8})
    chunks = build_model_chunks(config, parallel, dtype=torch.float32)
    out = (ps.get_pipeline_model_parallel_rank(), [chunk_layer_numbers(c) for c in chunks])
    ps.destroy_model_parallel()
    return out


FUSED_TEMPERATURE = 0.9


def _fused_weights(n):
    gen = torch.Generator().manual_seed(77)
    return torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def _fused_head_tp2(cases, world):
    """``model.fused_head`` at TP = 2 (x DP = 2): the output layer returns hidden states, core's
    logprobs_from_hidden takes them and the weight shard; log-probs, entropy and the gradients
    of the head's weight and of the final norm under sum(w_logp logp) + sum(w_ent H)."""
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.fused_head import emit_hidden, head_weight
    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_layout import load_hf_weights
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.maths.logprobs_hidden import logprobs_from_hidden

    parallel = ParallelConfig(tp=2, world_size=world)
    initialize_parallel_state(parallel)
    topo = topology_from_parallel_state()
    w_logp, w_ent = _fused_weights(BATCH * (SEQ - 1))
    out = {"tp_rank": topo.tp_rank}
    for name, (config, source, ids, _) in cases.items():
        (chunk,) = build_model_chunks(config, parallel, dtype=torch.float32)
        load_hf_weights([chunk], source, config, topo)
        emit_hidden([chunk])
        hidden = chunk(ids, torch.arange(SEQ)[None].expand(BATCH, SEQ), None)
        weight = head_weight(chunk)
        logp, entropy = logprobs_from_hidden(
            hidden[:, :-1].reshape(-1, hidden.shape[-1]),
            weight,
            ids[:, 1:].reshape(-1),
            tp_group=topo.groups.tp,
            temperature=FUSED_TEMPERATURE,
            vocab_size=VOCAB,
            with_entropy=True,
        )
        ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
        out[name] = {
            "hidden_shape": tuple(hidden.shape),
            "logp": logp.detach(),
            "entropy": entropy.detach(),
            "head": weight.grad.clone(),
            "norm": chunk.decoder.final_layernorm.weight.grad.clone(),
        }
    ps.destroy_model_parallel()
    return out


def _fused_reference(config, state, ids):
    """fp64 autograd through the HF model: log-probs, entropy at FUSED_TEMPERATURE, and the
    gradients of lm_head (the embedding when tied: both uses) and of the final norm."""
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float64, attn_implementation="eager"
    )
    model.load_state_dict({k: v.double() for k, v in state.items()})
    logits = model(ids).logits[:, :-1].reshape(-1, VOCAB) / FUSED_TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(1, ids[:, 1:].reshape(-1, 1)).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    w_logp, w_ent = _fused_weights(logp.shape[0])
    ((w_logp.double() * logp).sum() + (w_ent.double() * entropy).sum()).backward()
    return {
        "logp": logp.detach(),
        "entropy": entropy.detach(),
        "head": model.lm_head.weight.grad,
        "norm": model.model.norm.weight.grad,
    }


def _four_ranks(rank, world, cases, save_dir):
    # one spawn for every layout: starting 4 processes that import megatron costs ~30 s on 2 cores
    return {
        "tp2_pp2": _run_layout(2, 2, None, cases, world, save_dir),
        "pp2_vpp2": _run_layout(1, 2, 2, cases, world),
        "tp2_dp2": _run_layout(2, 1, None, cases, world),
        "eight_layers": _eight_layer_chunks(world),
        "fused_tp2": _fused_head_tp2(cases, world),
    }


def _one_rank(rank, world, cases):
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_layout import export_hf_state_dict, load_hf_weights
    from unirl.core.config.run_config import ParallelConfig

    results = _run_layout(1, 1, None, cases, world)
    # an explicit mask in Megatron's convention (True = masked out) gives the causal default
    initialize_parallel_state(ParallelConfig())
    topo = topology_from_parallel_state()
    config, source, ids, _ = next(iter(cases.values()))
    (chunk,) = build_model_chunks(config, ParallelConfig(), dtype=torch.float32)
    load_hf_weights([chunk], source, config, topo)
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1)[None, None]
    with torch.no_grad():
        results["mask_vs_causal"] = (chunk(ids, positions, future), chunk(ids, positions, None))
    # bf16: every parameter (torch norms included) in bf16, the export is the rounded HF weights
    for name, (config, source, _ids, _ref) in cases.items():
        chunks = build_model_chunks(config, ParallelConfig(), dtype=torch.bfloat16)
        load_hf_weights(chunks, source, config, topo)
        results[name]["param_dtypes"] = {p.dtype for c in chunks for p in c.parameters()}
        results[name]["export_bf16"] = export_hf_state_dict(chunks, config, topo)
    ps.destroy_model_parallel()
    results["config_errors"] = _config_errors()
    return results


def _unsupported_configs():
    """(HF config, parallel sizes, the message pattern expected) for what the model rejects."""
    bad_llama3 = {
        "rope_type": "llama3",
        "rope_theta": 1e4,
        "factor": 8.0,
        "low_freq_factor": 2.0,  # megatron-core fixes 1.0
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    llama = _configs()["llama_untied"]
    return [
        (
            transformers.LlamaConfig(**COMMON, rope_parameters=bad_llama3),
            {},
            r"model\.hf_config\.rope_scaling",
        ),
        (llama, {"tp": 4}, r"parallel\.tp=4 .*num_key_value_heads=2"),
        (
            transformers.LlamaConfig(**COMMON, attention_bias=True),
            {},
            r"model\.hf_config\.attention_bias",
        ),
        (llama, {"pp": 3}, r"num_hidden_layers=4 .*3 x 1"),
    ]


def _config_errors():
    from unirl.backends.megatron.model import check_hf_config
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.errors import ConfigError

    messages = []
    for config, sizes, _ in _unsupported_configs():
        try:
            check_hf_config(config, ParallelConfig(**sizes))
            messages.append(None)
        except ConfigError as err:
            messages.append(str(err))
    return messages


# --- checks -----------------------------------------------------------------------------------


def _assert_exact(exported, original, tied):
    expected = {k for k in original if not (tied and k == "lm_head.weight")}
    assert set(exported) == expected
    for key in expected:
        assert torch.equal(exported[key], original[key]), key


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """(cases, per-rank results, export folder) of the one 4-process spawn."""
    save_dir = tmp_path_factory.mktemp("megatron-export")
    cases = _cases(_configs())
    return cases, run_distributed(_four_ranks, 4, cases, str(save_dir)), save_dir


def test_layouts_round_trip_and_logprobs(four_ranks):
    cases, per_rank, tmp_path = four_ranks
    # Megatron rank order tp-dp-pp: with pp=2 ranks 0,1 are stage 0 and ranks 2,3 stage 1.
    expected_layers = {
        # 4 layers, pp=2: stage 0 holds HF layers 0-1, stage 1 layers 2-3
        "tp2_pp2": {0: [[0, 1]], 1: [[2, 3]]},
        # pp=2, vpp=2, one layer per chunk: chunks are interleaved across the stages
        "pp2_vpp2": {0: [[0], [2]], 1: [[1], [3]]},
        "tp2_dp2": {0: [[0, 1, 2, 3]]},
    }
    # padded vocabulary 100 -> multiple of 128 * tp: 256 rows at tp=2 (128 per rank), 128 at tp=1
    local_rows = {"tp2_pp2": 128, "pp2_vpp2": 128, "tp2_dp2": 128}
    for layout, by_stage in expected_layers.items():
        for name, (config, original, _ids, reference) in cases.items():
            for rank in range(4):
                res = per_rank[rank][layout][name]
                assert res["layers"] == by_stage[res["pp_rank"]], (layout, name, rank)
                for shape in res["local_vocab_rows"]:
                    assert shape == (local_rows[layout], 64)
                _assert_exact(res["export"], original, config.tie_word_embeddings)
                if res["logprobs"] is not None:
                    torch.testing.assert_close(
                        res["logprobs"].double(), reference, atol=LOGPROB_ATOL, rtol=0
                    )
            last_stage_ranks = [
                r for r in range(4) if per_rank[r][layout][name]["logprobs"] is not None
            ]
            assert last_stage_ranks == ([2, 3] if layout != "tp2_dp2" else [0, 1, 2, 3])

    # Megatron's interleaved split of 8 layers at pp=2, vpp=2: offset = vp * 8/2 + stage * 2
    for rank in range(4):
        stage, layers = per_rank[rank]["eight_layers"]
        assert layers == ([[0, 1], [4, 5]] if stage == 0 else [[2, 3], [6, 7]])
        assert stage == rank // 2

    # the tp2_pp2 export, written by rank 0, loads with from_pretrained to the original weights
    for name, (config, original, ids, reference) in cases.items():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / name, dtype=torch.float32, attn_implementation="eager"
        )
        state = loaded.state_dict()
        assert set(state) == set(original)
        for key, value in original.items():
            assert torch.equal(state[key], value), (name, key)
        assert loaded.config.tie_word_embeddings == config.tie_word_embeddings
        torch.testing.assert_close(_reference_logprobs(loaded.eval(), ids), reference)


def test_single_process_from_folder_and_config_errors(tmp_path):
    configs = {**_configs(), "llama3_rope": _llama3_rope_config()}
    cases = _cases(configs, seed=10)
    folder_cases = {}
    for name, (config, original, ids, reference) in cases.items():
        model = noisy_hf_model(config, 0)
        model.load_state_dict(original)
        model.save_pretrained(tmp_path / name)  # the worker reads these safetensors lazily
        folder_cases[name] = (config, str(tmp_path / name), ids, reference)
    (result,) = run_distributed(_one_rank, 1, folder_cases)
    for name, (config, original, _ids, reference) in cases.items():
        res = result[name]
        assert res["layers"] == [[0, 1, 2, 3]]
        assert res["local_vocab_rows"] == [(128, 64)]
        _assert_exact(res["export"], original, config.tie_word_embeddings)
        torch.testing.assert_close(res["logprobs"].double(), reference, atol=LOGPROB_ATOL, rtol=0)
        assert res["param_dtypes"] == {torch.bfloat16}
        rounded = {k: v.to(torch.bfloat16) for k, v in original.items()}
        _assert_exact(res["export_bf16"], rounded, config.tie_word_embeddings)
    masked, causal = result["mask_vs_causal"]
    torch.testing.assert_close(masked, causal, atol=1e-5, rtol=0)
    # unsupported configurations raise ConfigError naming the key (checked in the same process)
    for (_, _, pattern), message in zip(_unsupported_configs(), result["config_errors"]):
        assert message is not None and re.search(pattern, message), (pattern, message)


def test_fused_head_tp2_matches_hf_fp64(four_ranks):
    """Tied and untied; vocabulary 100 padded to 256 rows at TP = 2: rank 0 holds ids 0-99 and
    28 padding rows, rank 1 only padding."""
    cases, per_rank, _ = four_ranks
    rows_per_rank = 128
    close = dict(atol=1e-4, rtol=1e-4)
    for name, (config, state, ids, _) in cases.items():
        ref = _fused_reference(config, state, ids)
        for rank in range(4):
            res = per_rank[rank]["fused_tp2"]
            tp_rank, res = res["tp_rank"], res[name]
            assert res["hidden_shape"] == (BATCH, SEQ, 64)  # hidden states, not logits
            torch.testing.assert_close(res["logp"].double(), ref["logp"], **close)
            torch.testing.assert_close(res["entropy"].double(), ref["entropy"], **close)
            # the final norm sits before the head: its gradient needs every shard's share of
            # d/dhidden (the all-reduce in core's backward)
            torch.testing.assert_close(res["norm"].double(), ref["norm"], **close)
            rows = slice(tp_rank * rows_per_rank, (tp_rank + 1) * rows_per_rank)
            real = max(0, min(rows_per_rank, VOCAB - tp_rank * rows_per_rank))
            head = res["head"].double()
            torch.testing.assert_close(head[:real], ref["head"][rows][:real], **close)
            assert torch.all(head[real:] == 0), (name, rank, "padding rows")
