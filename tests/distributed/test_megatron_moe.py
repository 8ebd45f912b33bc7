"""Qwen3-MoE on the Megatron backend: per-token log-probs equal an independent fp64 `log_softmax`
of the Hugging Face fp32 model's logits on EP1, EP2, EP2 x TP2, EP2 x ETP2 and PP2 x EP2, and
HF -> Megatron -> HF is exact in each (experts gathered over the expert-parallel ranks); the
gradients of every weight equal HF's fp64 autograd on EP1, EP2 and EP2 x ETP2 (each data rank
with its own batch, so the ranks exchange uneven token counts).

Tiny models (hidden 64, 2 layers, 8 experts, top-2, expert FFN 48) with every parameter drawn at
random (norms and the router included). Two routings: ``norm_topk_prob`` on (both layers
sparse, untied head) and off (layer 0 dense through ``mlp_only_layers``, tied head), so each
of megatron's two softmax orders and the dense-layer pattern is compared.
"""

import importlib.util
import re
from types import SimpleNamespace

import pytest
import torch

from tests.contract.moe_reference import per_expert
from tests.spawn import run_distributed
from tests.tiny_models import MEGATRON_DIMS, noisy_hf_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

VOCAB = 100
BATCH, SEQ = 2, 11
LOGPROB_ATOL = 1e-4
EXPERTS, TOP_K = 8, 2
COMMON = dict(
    **MEGATRON_DIMS,
    num_hidden_layers=2,
    moe_intermediate_size=48,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    vocab_size=VOCAB,
)


def _configs():
    return {
        "renormalised": transformers.Qwen3MoeConfig(
            **COMMON, norm_topk_prob=True, tie_word_embeddings=False
        ),
        "plain_softmax_dense0": transformers.Qwen3MoeConfig(
            **COMMON, norm_topk_prob=False, tie_word_embeddings=True, mlp_only_layers=[0]
        ),
    }


def _reference(model, ids):
    """fp64 log-probs of the next tokens, [B * (S-1)], and each sparse layer's router logits
    [B * S, E] (HF's own, batch-major)."""
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logp = torch.log_softmax(out.logits.double()[:, :-1], dim=-1)
    logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1).reshape(-1)
    return logp, [r for r in out.router_logits if r is not None]


def _cases(seed=0, data_ranks=1):
    """Per config: (config, state, ids, reference log-probs, router logits), ids and references
    one per data-parallel rank: each rank routes its own tokens, so the expert-parallel ranks
    exchange uneven token counts."""
    out = {}
    for i, (name, config) in enumerate(_configs().items()):
        model = noisy_hf_model(config, seed + i)
        gen = torch.Generator().manual_seed(i)
        ids = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(data_ranks)]
        state = {k: v.clone() for k, v in model.state_dict().items()}
        refs = [_reference(model, x) for x in ids]
        out[name] = (config, state, ids, [r[0] for r in refs], [r[1] for r in refs])
    return out


# --- worker side ------------------------------------------------------------------------------


def _pipeline_logprobs(chunks, topo, ids):
    """The chunks run in pipeline order by hand, each stage's output broadcast over the pipeline
    group (independent of megatron's schedules)."""
    import torch.distributed as dist

    from unirl.core.maths.logprobs import logprobs_from_logits

    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    hidden, out = None, None
    for stage in range(topo.pp_size):
        if stage == topo.pp_rank:
            chunks[0].set_input_tensor(hidden)
            with torch.no_grad():
                out = chunks[0](ids, positions, None)
        if stage == topo.pp_size - 1:
            break
        buf = out if stage == topo.pp_rank else torch.empty(SEQ, BATCH, 64)
        dist.broadcast(buf, src=dist.get_global_rank(topo.groups.pp, stage), group=topo.groups.pp)
        hidden = buf
    if not topo.is_last_pipeline_stage():
        return None
    logits = out[:, :-1].reshape(-1, out.shape[-1])
    return logprobs_from_logits(
        logits,
        ids[:, 1:].reshape(-1),
        tp_group=topo.groups.tp if topo.tp_size > 1 else None,
        vocab_size=VOCAB,
    )


def _run_layout(sizes, cases, world):
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.compat import cpu as cpu_compat
    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_layout import export_hf_state_dict, load_hf_weights
    from unirl.backends.megatron.weights.stream import stream_weights
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.topology import Topology
    from unirl.core.weights.stream import HOST

    cpu_compat.install()
    parallel = ParallelConfig(world_size=world, **sizes)
    initialize_parallel_state(parallel)
    topo = topology_from_parallel_state()
    # core's prediction of megatron's ranks, without megatron
    predicted = Topology.from_rank(topo.rank, world, **sizes)
    results = {
        "predicted_equal": predicted == topo,
        "topology": {
            k: getattr(topo, k)
            for k in ("ep_size", "ep_rank", "etp_size", "etp_rank", "edp_size", "edp_rank")
        }
        | {"ep_members": torch.distributed.get_process_group_ranks(topo.groups.ep)}
        | {"edp_members": torch.distributed.get_process_group_ranks(topo.groups.edp)},
    }
    for name, (config, source, ids, _, _) in cases.items():
        chunks = build_model_chunks(config, parallel, dtype=torch.float32)
        load_hf_weights(chunks, source, config, topo)
        for chunk in chunks:
            chunk.eval()
        results[name] = {
            "dp_rank": topo.dp_rank,
            "local_experts": [
                list(layer.mlp.local_expert_indices)
                for c in chunks
                for layer in c.decoder.layers
                if hasattr(layer.mlp, "local_expert_indices")
            ],
            "export": export_hf_state_dict(chunks, config, topo),
            # issue 28: the weight stream to rank 0, small buckets (experts over EP / etp)
            "stream": [
                (n, t)
                for bucket in stream_weights(chunks, config, topo, 2048, dst=0, device=HOST)
                for n, t in bucket
            ],
            "logprobs": _pipeline_logprobs(chunks, topo, ids[topo.dp_rank]),
        }
    if sizes.get("tp", 1) == 1 and sizes.get("pp", 1) == 1:
        # backward through the all-to-all: each rank's own batch, its own (un-reduced) gradients
        results["tp_ep_members"] = torch.distributed.get_process_group_ranks(
            ps.get_expert_tensor_and_model_parallel_group()
        )
        config, state, ids, _, _ = cases["renormalised"]
        results["grads"] = _gradients((config, state, [ids[topo.dp_rank]], None, None), topo)
    ps.destroy_model_parallel()
    results["cpu_compat_lines"] = sorted(cpu_compat.reached_lines())
    return results


LAYOUTS = {
    "ep2": dict(ep=2),  # dp 4, expert dp 2
    # expert TP = TP = 2, forward only and without sequence parallel (the plug-in asks for it
    # when training: test_megatron_moe_tp.py)
    "ep2_tp2": dict(ep=2, tp=2),
    "ep2_etp2": dict(ep=2, etp=2),  # attention unsplit, each expert over 2 ranks
    "pp2_ep2": dict(pp=2, ep=2),
}


def _four_ranks(rank, world, cases):
    # one spawn for every layout: starting 4 processes that import megatron costs ~30 s on 2 cores
    return {layout: _run_layout(sizes, cases, world) for layout, sizes in LAYOUTS.items()}


def _one_rank(rank, world, cases, folders):
    """EP1: from the in-memory (fused) state dict and from a saved folder (per-expert
    safetensors); the routers' recorded logits; the refusals."""
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.compat import cpu as cpu_compat
    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.moe.layers import collect_router_logits
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_layout import export_hf_state_dict, load_hf_weights
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.errors import ConfigError

    cpu_compat.install()
    results = _run_layout({}, cases, world)
    initialize_parallel_state(ParallelConfig())
    topo = topology_from_parallel_state()
    for name, (config, _state, ids, _, _) in cases.items():
        (chunk,) = build_model_chunks(config, ParallelConfig(), dtype=torch.float32)
        load_hf_weights([chunk], folders[name], config, topo)
        results[name]["export_from_folder"] = export_hf_state_dict([chunk], config, topo)
        chunk(ids[0], torch.arange(SEQ)[None].expand(BATCH, SEQ), None)  # autograd on: recorded
        results[name]["router_logits"] = [t.detach() for t in collect_router_logits([chunk])]
        results[name]["router_logits_after"] = collect_router_logits([chunk])
    results["grads"] = _gradients(cases["renormalised"], topo)
    config, state, _, _, _ = cases["renormalised"]
    refusals = {}
    (chunk,) = build_model_chunks(config, ParallelConfig(), dtype=torch.float32)
    extra = dict(state)
    extra["model.layers.0.mlp.shared_expert.up_proj.weight"] = torch.zeros(4, 64)
    missing = {k: v for k, v in per_expert(state).items() if "experts.7.down_proj" not in k}
    for key, source in (("extra", extra), ("missing", missing)):
        try:
            load_hf_weights([chunk], source, config, topo)
            refusals[key] = None
        except ConfigError as err:
            refusals[key] = str(err)
    results["refusals"] = refusals
    ps.destroy_model_parallel()
    return results


def _weights(n):
    return torch.linspace(-1.0, 1.0, n)


def _gradients(case, topo):
    """d/dθ sum_t w_t logp_t in train mode, the gradients written into the parameters and read
    out in HF names by the (exact, tested) export."""
    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.weights.hf_layout import export_hf_state_dict, load_hf_weights
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.maths.logprobs import logprobs_from_logits

    config, state, ids, _, _ = case
    parallel = ParallelConfig(
        world_size=topo.world_size, ep=topo.ep_size, etp=topo.etp_size if topo.ep_size > 1 else None
    )
    (chunk,) = build_model_chunks(config, parallel, dtype=torch.float32)
    load_hf_weights([chunk], state, config, topo)
    out = chunk(ids[0], torch.arange(SEQ)[None].expand(BATCH, SEQ), None)
    logp = logprobs_from_logits(
        out[:, :-1].reshape(-1, out.shape[-1]), ids[0][:, 1:].reshape(-1), vocab_size=VOCAB
    )
    (_weights(logp.numel()) * logp).sum().backward()
    with torch.no_grad():
        for param in chunk.parameters():
            param.copy_(param.grad)
    return export_hf_state_dict([chunk], config, topo)


def _reference_gradients(case, index=0):
    """The same objective through the HF model in fp64 (its own router and experts), on the
    batch ``ids[index]``."""
    config, state, ids, _, _ = case
    ids = ids[index:]
    model = transformers.AutoModelForCausalLM.from_config(
        # the experts' per-expert loop (torch's grouped matmul has no fp64)
        config,
        dtype=torch.float64,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    model.load_state_dict({k: v.double() for k, v in state.items()})
    logits = model(ids[0]).logits[:, :-1].reshape(-1, VOCAB)
    logp = torch.log_softmax(logits, -1).gather(1, ids[0][:, 1:].reshape(-1, 1)).squeeze(1)
    (_weights(logp.numel()).double() * logp).sum().backward()
    return per_expert({n: p.grad for n, p in model.named_parameters()})


# --- checks -----------------------------------------------------------------------------------


def _assert_exact(exported, original, tied):
    expected = {
        k: v for k, v in per_expert(original).items() if not (tied and k == "lm_head.weight")
    }
    assert set(exported) == set(expected)
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key


def test_moe_layouts_logprobs_and_round_trip():
    cases = _cases(data_ranks=4)
    per_rank = run_distributed(_four_ranks, 4, cases)
    # the expert view each layout gives, rank by rank: megatron's order etp-ep-edp-pp
    expected_view = {
        "ep2": [(2, r % 2, 1, 0, 2, r // 2) for r in range(4)],
        "ep2_tp2": [(2, r // 2, 2, r % 2, 1, 0) for r in range(4)],
        "ep2_etp2": [(2, r // 2, 2, r % 2, 1, 0) for r in range(4)],
        "pp2_ep2": [(2, r % 2, 1, 0, 1, 0) for r in range(4)],
    }
    for layout in LAYOUTS:
        last_stage = []
        for rank in range(4):
            res = per_rank[rank][layout]
            view = res["topology"]
            assert res["predicted_equal"], (layout, rank)
            assert tuple(view[k] for k in list(view)[:6]) == expected_view[layout][rank], layout
            assert rank in view["ep_members"] and len(view["ep_members"]) == 2
            for name, (config, original, _ids, reference, _) in cases.items():
                out = res[name]
                # ep rank r holds experts [4r, 4r + 4) of every sparse layer
                ep_rank = view["ep_rank"]
                for experts in out["local_experts"]:
                    assert experts == list(range(4 * ep_rank, 4 * ep_rank + 4)), (layout, rank)
                _assert_exact(out["export"], original, config.tie_word_embeddings)
                streamed = dict(out["stream"])  # rank 0 receives all, bit for bit; others none
                assert (
                    len(streamed) == len(out["stream"]) == (len(out["export"]) if rank == 0 else 0)
                )
                for n, t in streamed.items():
                    assert torch.equal(t, out["export"][n]) and t.dtype == out["export"][n].dtype
                if out["logprobs"] is not None:
                    last_stage.append(rank)
                    torch.testing.assert_close(
                        out["logprobs"].double(),
                        reference[out["dp_rank"]],
                        atol=LOGPROB_ATOL,
                        rtol=0,
                    )
        assert len(last_stage) == (2 if layout == "pp2_ep2" else 4) * len(cases), layout
    # the all-to-all ran on gloo through cpu_compat, every line it patched listed
    from unirl.backends.megatron.compat import cpu as cpu_compat

    # gradients under expert parallel: a rank's dense weights see its own batch; an expert sees
    # the tokens routed to it from every rank of its expert tensor x expert parallel group
    renormalised = cases["renormalised"]
    reference = [_reference_gradients(renormalised, i) for i in range(4)]
    for layout in ("ep2", "ep2_etp2"):
        for rank in range(4):
            res = per_rank[rank][layout]
            senders = [per_rank[m][layout]["renormalised"]["dp_rank"] for m in res["tp_ep_members"]]
            own = res["renormalised"]["dp_rank"]
            assert set(res["grads"]) == set(reference[0])
            for name, grad in res["grads"].items():
                ranks = senders if ".mlp.experts." in name else [own]
                expected = sum(reference[i][name] for i in ranks)
                torch.testing.assert_close(grad.double(), expected, atol=1e-5, rtol=1e-4)
    reached = set().union(
        *(per_rank[r][layout]["cpu_compat_lines"] for r in range(4) for layout in LAYOUTS)
    )
    assert "tensor_parallel/mappings.py:442" in reached  # the all-to-all-v buffer
    assert "tensor_parallel/mappings.py:150" in reached  # uneven gather over expert TP (gloo)
    assert reached <= cpu_compat.listed_lines(), sorted(reached - cpu_compat.listed_lines())


def test_moe_one_rank_folder_router_logits_and_refusals(tmp_path):
    cases = _cases(seed=10)
    folders = {}
    for name, (config, state, _, _, _) in cases.items():
        model = noisy_hf_model(config, 0)
        model.load_state_dict(state)
        model.save_pretrained(tmp_path / name)  # per-expert checkpoint names on disk
        folders[name] = str(tmp_path / name)
    (result,) = run_distributed(_one_rank, 1, cases, folders)
    for name, (config, original, _ids, reference, router_ref) in cases.items():
        res = result[name]
        assert res["local_experts"] == (
            [list(range(EXPERTS))] * (1 if config.mlp_only_layers else 2)
        )
        _assert_exact(res["export"], original, config.tie_word_embeddings)
        _assert_exact(res["export_from_folder"], original, config.tie_word_embeddings)
        torch.testing.assert_close(
            res["logprobs"].double(), reference[0], atol=LOGPROB_ATOL, rtol=0
        )
        router_ref = router_ref[0]
        # one [tokens, experts] tensor per sparse layer; megatron flattens [S, B], HF [B, S]
        assert len(res["router_logits"]) == len(router_ref)
        for mine, hf in zip(res["router_logits"], router_ref):
            assert mine.shape == (BATCH * SEQ, EXPERTS)
            seq_major = hf.reshape(BATCH, SEQ, EXPERTS).transpose(0, 1).reshape(-1, EXPERTS)
            torch.testing.assert_close(mine, seq_major, atol=1e-5, rtol=1e-5)
        assert res["router_logits_after"] == []  # collecting empties the routers' lists
    # gradients of every weight, router and experts included, against HF's fp64 autograd
    reference_grads = _reference_gradients(cases["renormalised"])
    assert set(result["grads"]) == set(reference_grads)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(result["grads"][name].double(), grad, atol=1e-5, rtol=1e-4)
    extra, missing = result["refusals"]["extra"], result["refusals"]["missing"]
    assert extra is not None and "mlp.shared_expert.up_proj.weight" in extra, extra
    assert missing is not None and "experts.7.down_proj.weight" in missing, missing


def _plugin_errors():
    from unirl.backends.megatron.plugin import _check_experts
    from unirl.core.config.run_config import AlgorithmConfig, ModelConfig, ParallelConfig
    from unirl.core.errors import ConfigError

    moe = {"model_type": "qwen3_moe", "num_experts": 8}
    saved = {"model_type": "qwen3_moe", "num_local_experts": 8}
    dense = {"model_type": "qwen3"}
    cases = [
        (dense, {"ep": 2}, r"parallel\.ep=2.*dense"),
        (moe, {"ep": 3}, r"parallel\.ep=3 does not divide .*num_experts=8"),
        (
            moe,
            {"ep": 2, "tp": 2},
            r"parallel\.tp=2 with a mixture-of-experts model needs .*"
            r"sequence_parallel: true",
        ),
        (moe, {"ep": 2, "tp": 2, "sequence_parallel": True}, None),
        (moe, {"ep": 2, "etp": 2}, None),
        # a folder saved by transformers 5 names the expert count num_local_experts
        (saved, {"ep": 2}, None),
        (saved, {"ep": 3}, r"parallel\.ep=3 does not divide .*num_experts=8"),
    ]
    out = []
    for hf, sizes, pattern in cases:
        # the sections the check reads
        cfg = SimpleNamespace(
            parallel=ParallelConfig(**sizes),
            model=ModelConfig(hf_config=hf),
            algorithm=AlgorithmConfig(),
        )
        try:
            _check_experts(cfg)
            out.append((pattern, None))
        except ConfigError as err:
            out.append((pattern, str(err)))
    return out


def test_expert_parallel_config_refusals():
    """What the plug-in refuses before any process starts (the model-side checks run at build)."""
    from unirl.backends.megatron.model import check_hf_config
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.errors import ConfigError

    for pattern, message in _plugin_errors():
        if pattern is None:
            assert message is None
        else:
            assert message is not None and re.search(pattern, message), (pattern, message)
    top1 = transformers.Qwen3MoeConfig(**{**COMMON, "num_experts_per_tok": 1}, norm_topk_prob=True)
    with pytest.raises(ConfigError, match=r"num_experts_per_tok=1 with norm_topk_prob=True"):
        check_hf_config(top1, ParallelConfig())
    with pytest.raises(ConfigError, match=r"parallel\.etp=5 does not divide .*=48"):
        check_hf_config(_configs()["renormalised"], ParallelConfig(etp=5))
