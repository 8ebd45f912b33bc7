"""Routing replay on the Megatron backend against Hugging Face fp32.

The tiny Qwen3-MoE of the replay tests (`tests/unit/replay_fixtures.MOE_HF`: 3 layers, the
middle one dense, 6 experts, top-2), built by the backend from ``model.hf_config`` +
``init_seed``, its routers made decisive (weights drawn at std 1 and loaded through the HF
conversion). R3: a packed microbatch of two sequences with forced experts (one token-layer
`FREE`) through `forward_logprobs` and `forward_backward`; the reference is the HF model with the
backend's weights whose sparse blocks route to the forced experts, computed by hand
(`tests.unit.test_hf_router_replay.hand_forced`), each sequence run alone. R2: the recorded
experts of a forward-only pass equal the top-k of HF's own router probabilities. On EP1 and EP2
(each expert-parallel rank holds 3 experts; tokens reach them by all-to-all), PP2 (4 layers,
the second dense: each stage replays its own layers, the records are gathered over the pipeline,
the disagreement counts summed over it) and TP2 x EP2 with sequence parallel on two ranks (each
TP rank replays and records its slice of the 11-token stream, padded to 12; the slices are
gathered over TP, the counts summed over it).
"""

import importlib.util
import itertools

import pytest
import torch

from tests.distributed.test_megatron_router_losses import _microbatch, _per_expert_to_hf
from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH
from tests.unit.replay_fixtures import MOE_HF

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

LENGTHS = [6, 5]
EXPERTS, TOP_K = MOE_HF["num_experts"], MOE_HF["num_experts_per_tok"]
# PP2: 4 layers (layer 1 dense), so stage 0 holds MoE layer 0 and stage 1 MoE layers 1 and 2
FOUR_LAYERS = {**MOE_HF, "num_hidden_layers": 4}


def _hf_fields(pp, tp=1):
    fields = dict(FOUR_LAYERS if pp > 1 else MOE_HF)
    if tp > 1:  # whole key / value heads on each TP rank
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    return fields


def _moe_layers(hf):
    return sum(1 for i in range(hf["num_hidden_layers"]) if i not in hf["mlp_only_layers"])


def _forced(hf):
    g = torch.Generator().manual_seed(2)
    layers = _moe_layers(hf)
    forced = torch.rand(sum(LENGTHS), layers, EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
    forced = forced.to(torch.int32)
    forced[4, 1] = -1  # FREE: one token-layer left to the router
    return forced


def _config(mode, ep, pp, tp=1):
    return {
        "backend": "megatron",
        "model": {"hf_config": _hf_fields(pp, tp), "init_seed": 5, "max_seq_len": 16},
        "optimizer": {"lr": 1e-3},
        "batch": dict(TINY_BATCH),
        "parallel": {"ep": ep, "pp": pp}
        if tp == 1
        else {"ep": ep, "pp": pp, "tp": tp, "etp": 1, "sequence_parallel": True},
        "algorithm": {"routing_replay": mode},
        # rollout: an engine's experts, from a file (the sampler records none)
        **({"rollout": {"source": "file", "file": "r3.jsonl"}} if mode == "rollout" else {}),
        "train": {"seed": 0},
        "logging": {"tensorboard": False},
    }


def _decisive(state):
    """The backend's weights with routers drawn at std 1 (HF's init is near-uniform)."""
    g = torch.Generator().manual_seed(9)
    out = dict(state)
    for name, t in state.items():
        if name.endswith("mlp.gate.weight"):
            out[name] = torch.randn(t.shape, generator=g)
    return out


def _worker(rank, world_size, ep, pp, tp):
    from unirl.backends.megatron import build_backend
    from unirl.backends.megatron.weights.hf_layout import load_hf_weights
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.moe_loss import LossWithRouterTerm
    from unirl.core.progress.bars import MicrobatchProgress

    out = {}
    for mode in ("rollout", "record"):
        cfg = config_from_dict(_config(mode, ep, pp, tp), world_size=world_size)
        backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
        state = _decisive(backend.hf_state_dict())
        load_hf_weights(backend.model, state, backend.hf_config, backend.topology)
        # the forward-only pass records (R2) or replays (R3); the training pass replays
        forward = "replay" if mode == "rollout" else "record"
        spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size, routing=forward)
        train_spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size, routing="replay")
        vocab = MOE_HF["vocab_size"]
        if mode == "rollout":
            forced = _forced(_hf_fields(pp, tp))
            mb = _microbatch(LENGTHS, seed=1, vocab=vocab, routed_experts=forced)
            with MicrobatchProgress("test", 1, backend.topology, enabled=False) as bar:
                out["replayed"] = backend.forward_logprobs(
                    [mb], role="policy", spec=spec, progress=bar
                )

            def policy(mb, logprobs, entropy):
                return (logprobs * mb.loss_mask).sum(), {}

            # no router term (every pipeline stage reads the loss's router settings)
            loss_fn = LossWithRouterTerm(policy=policy, router=None, global_tokens=mb.num_tokens)

            with MicrobatchProgress("test", 1, backend.topology, enabled=False) as bar:
                metrics = backend.forward_backward(
                    [mb], loss_fn=loss_fn, spec=train_spec, progress=bar
                )
            out["disagreement"] = metrics[0]["router/disagreement"] if metrics else None
            out["state"] = state
        else:
            mb = _microbatch(LENGTHS, seed=1, vocab=vocab)
            with MicrobatchProgress("test", 1, backend.topology, enabled=False) as bar:
                backend.forward_logprobs([mb], role="policy", spec=spec, progress=bar)
            (out["recorded"],) = backend.recorded_routing()
        backend.close()
    return out


def _hf(state, hf):
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model("qwen3_moe", **fields)
    model = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    model.load_state_dict(_per_expert_to_hf(state, model, experts=EXPERTS), strict=True)
    return model


@pytest.mark.parametrize(
    ("ep", "pp", "tp"),
    [
        pytest.param(1, 1, 1, id="ep1"),
        # the slow tier (tests/conftest.py): about 80 s and 55 s on two cores; R3 under TP x SP
        # also runs in the contract's moe-tp2-ep2-sp layout (default tier)
        pytest.param(2, 1, 1, id="ep2", marks=pytest.mark.slow),
        pytest.param(1, 2, 1, id="pp2", marks=pytest.mark.slow),
        pytest.param(2, 1, 2, id="tp2-ep2-sp", marks=pytest.mark.slow),
    ],
)
def test_replay_and_record_match_hugging_face(ep, pp, tp):
    from tests.unit.test_hf_router_replay import hand_forced

    hf = _hf_fields(pp, tp)
    world = max(ep, tp) * pp  # tp x ep: the experts over the TP ranks (etp 1)
    results = run_distributed(_worker, world, ep, pp, tp)
    model = _hf(results[0]["state"], hf)
    mb = _microbatch(LENGTHS, seed=1, vocab=MOE_HF["vocab_size"])
    forced = _forced(hf)
    want, free_topk = [], []
    with torch.no_grad():
        for start, end in itertools.pairwise(mb.cu_seqlens.tolist()):
            ids = mb.tokens[start:end][None]
            # the forced rows of this sequence only
            seq_ref, _ = hand_forced(model, forced[start:end])
            logits = seq_ref(input_ids=ids, use_cache=False).logits[0].double()
            want.append(torch.log_softmax(logits, -1).gather(1, mb.targets[start:end, None])[:, 0])
            router = model(input_ids=ids, output_router_logits=True).router_logits
            free_topk.append(
                torch.stack(
                    [
                        torch.softmax(r.float(), -1).topk(TOP_K).indices
                        for r in router
                        if r is not None
                    ],
                    dim=1,
                )
            )
    want, free_topk = torch.cat(want), torch.cat(free_topk)
    valid = mb.loss_mask.bool()
    last = [r for r in results if r["replayed"]]  # the ranks of the last pipeline stage
    assert len(last) == world // pp
    for r in last:
        (replayed,) = r["replayed"]
        torch.testing.assert_close(replayed.double()[valid], want[valid], atol=1e-5, rtol=0)
    for r in results:
        # R2: the free top-k of each token and MoE layer, as sets, on every rank
        assert r["recorded"].shape == (sum(LENGTHS), _moe_layers(hf), TOP_K)
        assert torch.equal(r["recorded"].sort(-1).values.long(), free_topk.sort(-1).values)
    for r in last:
        # every forced token-layer decision counted once (summed over the stages)
        metric = r["disagreement"]
        forced_rows = int((forced[:, :, 0] != -1).sum())
        assert float(metric.denominator) == forced_rows
        differing = ((forced.sort(-1).values != free_topk.sort(-1).values).any(-1)) & (
            forced[:, :, 0] != -1
        )
        assert float(metric.numerator) == int(differing.sum()) > 0
