"""Qwen3-MoE on the Megatron backend under attention tensor parallel: EP2 x TP2 with sequence
parallel (4 ranks: attention tp 2 x dp 2; experts etp 2 x ep 2, or etp 1 x ep 2 x expert-dp 2),
against the Hugging Face fp32 model.

The backend loads a Hugging Face folder written here (a tiny Qwen3-MoE, 2 sparse layers, 8
experts, top-2, every weight random: norms, q/k norms and routers included) and, per
``megatron.attention`` (packed, then padded, in the same processes):

(the default tier runs packed EP2 x TP2; padded and expert TP 1 are in the slow tier)

- its export (`hf_state_dict`) equals the folder's tensors bit for bit (HF -> Megatron -> HF in
  this layout, experts gathered over the expert-parallel and expert-tensor ranks);
- `forward_logprobs` equals the HF model's ``log_softmax`` of each sequence run alone;
- one `forward_backward` (each data rank its own two microbatches; the loss a weighted sum of
  the log-probs plus core's router term with large coefficients, so the routers' gradients are
  dominated by the auxiliary and z-losses, whose logits each TP rank records for its slice of
  the sequence) gives the gradient of every weight of HF's autograd on the same objective summed
  over both data ranks, and the router metrics of HF's own ``load_balancing_loss_func``.
"""

import importlib.util
import itertools

import pytest
import torch

from tests.contract.moe_reference import per_expert
from tests.distributed.test_megatron_router_losses import (
    AUX_COEF,
    HF_CONFIG,
    LENGTHS,
    Z_COEF,
    _microbatch,
    _weights,
)
from tests.spawn import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")

WORLD = 4
ATTENTION = ("packed", "padded")


def _hf_config():
    fields = {k: v for k, v in HF_CONFIG.items() if k != "model_type"}
    return transformers.AutoConfig.for_model("qwen3_moe", **fields)


def _hf_model(seed=0):
    """The HF fp32 model with every parameter drawn at random (eager attention and experts)."""
    gen = torch.Generator().manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        _hf_config(),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def _microbatches(dp_rank):
    return [_microbatch(lengths, seed=10 * dp_rank + i) for i, lengths in enumerate(LENGTHS)]


def _config(folder, attention, etp):
    return {
        "backend": "megatron",
        "model": {"path": folder, "max_seq_len": 16},
        "optimizer": {"lr": 1e-3},
        "batch": {
            "prompts_per_rollout": 4,
            "samples_per_prompt": 2,
            "samples_per_optimizer_step": 8,
            "micro_batch_size": 2,
        },
        "algorithm": {"router_aux_loss_coef": AUX_COEF, "router_z_loss_coef": Z_COEF},
        "megatron": {"attention": attention},
        "parallel": {"tp": 2, "ep": 2, "etp": etp, "sequence_parallel": True},
        "train": {"seed": 0},
        "logging": {"tensorboard": False},
    }


def _loss_fn(settings, global_tokens):
    """A weighted sum of the log-probs plus core's router term."""
    from unirl.core.moe_loss import router_term

    def loss_fn(mb, logprobs, entropy, /, *, router_logits=None):
        assert router_logits is not None, "the backend hands the router logits"
        term = router_term(router_logits, mb, settings, global_tokens=global_tokens)
        lp = (_weights(mb.num_tokens) * mb.loss_mask * logprobs).sum()
        return lp + term.loss, term.metrics

    return loss_fn


def _worker(rank, world_size, folder, etp, attentions):
    from unirl.backends.megatron import build_backend
    from unirl.core.config.model_shape import moe_shape
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.moe_loss import RouterLossSettings
    from unirl.core.progress.bars import MicrobatchProgress

    out = {}
    for attention in attentions:
        cfg = config_from_dict(_config(folder, attention, etp), world_size=world_size)
        backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
        topo = backend.topology
        mbs = _microbatches(topo.dp_rank)
        global_tokens = WORLD // 2 * sum(sum(lengths) for lengths in LENGTHS)  # both data ranks
        loss_fn = _loss_fn(RouterLossSettings.from_config(cfg, moe_shape(cfg.model)), global_tokens)

        spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size)
        exported = backend.hf_state_dict()
        with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
            logprobs = backend.forward_logprobs(mbs, role="policy", spec=spec, progress=bar)
        with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
            metrics = backend.forward_backward(mbs, loss_fn=loss_fn, spec=spec, progress=bar)
        with torch.no_grad():
            for chunk in backend.model:
                for param in chunk.parameters():
                    param.copy_(param.main_grad)
        grads = backend.hf_state_dict()
        view = (topo.tp_size, topo.ep_size, topo.etp_size, topo.edp_size, topo.dp_size)
        backend.close()
        out[attention] = {
            "dp_rank": topo.dp_rank,
            "view": view,
            "export": exported,
            "logprobs": [t.cpu() for t in logprobs],
            "metrics": metrics,
            "grads": grads,
        }
    return out


def _reference(model):
    """Per data rank: each microbatch's log-probs and (aux, z); and the gradients (per-expert
    names) of the objective summed over both data ranks' microbatches."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    experts, top_k = HF_CONFIG["num_experts"], HF_CONFIG["num_experts_per_tok"]
    per_rank = [_microbatches(dp) for dp in range(WORLD // 2)]
    global_tokens = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
    total, logprobs, values = 0.0, [], []
    for mbs in per_rank:
        rank_logprobs, rank_values = [], []
        for mb in mbs:
            logps, layer_rows = [], None
            for start, end in itertools.pairwise(mb.cu_seqlens.tolist()):
                out = model(mb.tokens[start:end][None], output_router_logits=True)
                logp = torch.log_softmax(out.logits[0], -1).gather(1, mb.targets[start:end, None])
                logps.append(logp[:, 0])
                rows = [r.reshape(-1, experts) for r in out.router_logits]
                layer_rows = (
                    rows if layer_rows is None else [torch.cat(p) for p in zip(layer_rows, rows)]
                )
            logp = torch.cat(logps)
            aux = load_balancing_loss_func(tuple(layer_rows), experts, top_k)
            z = torch.logsumexp(torch.cat(layer_rows), -1).square().mean()
            rank_logprobs.append(logp.detach())
            rank_values.append((aux.item(), z.item()))
            lp = (_weights(mb.num_tokens) * mb.loss_mask * logp).sum()
            total = total + lp + (AUX_COEF * aux + Z_COEF * z) * mb.num_tokens / global_tokens
        logprobs.append(rank_logprobs)
        values.append(rank_values)
    total.backward()
    return logprobs, values, per_expert({n: p.grad for n, p in model.named_parameters()})


def _check(per_rank, model, attentions, expected_view):
    original = per_expert(model.state_dict())
    ref_logprobs, ref_values, ref_grads = _reference(model)
    for attention in attentions:
        for rank, result in enumerate(per_rank):
            res = result[attention]
            assert res["view"] == expected_view, (attention, rank)
            label = (attention, rank)
            # HF -> Megatron (this layout) -> HF, bit for bit
            assert set(res["export"]) == set(original), label
            for name, value in original.items():
                assert torch.equal(res["export"][name], value), (label, name)
            dp = res["dp_rank"]
            for mine, ref in zip(res["logprobs"], ref_logprobs[dp], strict=True):
                torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)
            for mb_metrics, lengths, (aux, z) in zip(res["metrics"], LENGTHS, ref_values[dp]):
                n = sum(lengths)
                assert float(mb_metrics["router/aux_loss"].numerator) / n == pytest.approx(
                    aux, rel=1e-5
                )
                assert float(mb_metrics["router/z_loss"].numerator) / n == pytest.approx(
                    z, rel=1e-5
                )
            assert set(res["grads"]) == set(ref_grads), label
            for name, grad in ref_grads.items():
                torch.testing.assert_close(
                    res["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=f"{label} {name}"
                )


def _folder(tmp_path):
    model = _hf_model()
    model.save_pretrained(tmp_path / "hf")  # per-expert checkpoint names on disk
    return model, str(tmp_path / "hf")


def test_moe_ep2_tp2_sequence_parallel_matches_hugging_face(tmp_path):
    """EP2 x TP2 x SP, expert TP = TP (each expert's FFN split over the two TP ranks), packed."""
    model, folder = _folder(tmp_path)
    per_rank = run_distributed(_worker, WORLD, folder, None, ("packed",))
    # (tp, ep, etp, expert dp, dp)
    _check(per_rank, model, ("packed",), (2, 2, 2, 1, 2))


# the slow tier (tests/conftest.py): about 1.5 min each on two cores; the packed EP2 x TP2 above
# covers the sequence split of the MoE layers in the default tier
@pytest.mark.slow
def test_moe_ep2_tp2_sequence_parallel_padded_matches_hugging_face(tmp_path):
    """The same layout with right-padded rows (``megatron.attention: padded``)."""
    model, folder = _folder(tmp_path)
    per_rank = run_distributed(_worker, WORLD, folder, None, ("padded",))
    _check(per_rank, model, ("padded",), (2, 2, 2, 1, 2))


@pytest.mark.slow
def test_moe_ep2_tp2_etp1_matches_hugging_face(tmp_path):
    """Attention split over TP, experts whole (etp 1) over EP with expert data parallel 2."""
    model, folder = _folder(tmp_path)
    per_rank = run_distributed(_worker, WORLD, folder, 1, ATTENTION)
    _check(per_rank, model, ATTENTION, (2, 2, 1, 2, 2))


def test_moe_tensor_parallel_needs_sequence_parallel():
    """The plug-in's check, before any process starts."""
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.errors import ConfigError

    data = _config(None, "packed", None)
    data["model"] = {"hf_config": dict(HF_CONFIG), "init_seed": 3, "max_seq_len": 16}
    data["parallel"] = {"tp": 2, "ep": 2}
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: true"):
        config_from_dict(data, world_size=WORLD)
    # with it, routing replay is accepted too (each TP rank replays its slice of the sequence;
    # the contract's moe-tp2-ep2-sp layout checks the numbers)
    data["parallel"]["sequence_parallel"] = True
    data["algorithm"] = {"routing_replay": "rollout"}
    data["rollout"] = {"source": "file", "file": "r3.jsonl"}  # the sampler records no experts
    assert config_from_dict(data, world_size=WORLD).algorithm.routing_replay == "rollout"
