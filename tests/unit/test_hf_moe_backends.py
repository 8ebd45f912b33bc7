"""Qwen3-MoE on the Hugging Face backends (DeepSpeed ZeRO-0 and FSDP2, one process) against plain
transformers fp32 references written here:

- training: the packed forward's log-probs, and one optimizer step on a loss that holds the
  router's auxiliary terms (core's `router_term`, coefficients from ``algorithm``) equal a
  per-sequence transformers forward whose router terms are transformers' own
  ``load_balancing_loss_func`` over each microbatch's tokens and a hand-written z-loss (gradient
  norm before clipping, the updated weights, the ``router/aux_loss`` / ``router/z_loss`` metrics);
- R3 (``routing_replay: rollout``): forward-only and training log-probs with the experts forced
  equal the hand-forced forward of tests/unit/test_hf_router_replay.py;
- R2 (``record``): the forward-only pass records the routers' own top-k; after the routers change,
  the training forward replaying them equals the hand-forced forward at the recorded experts.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
from transformers.models.qwen3_moe.modeling_qwen3_moe import (  # noqa: E402
    load_balancing_loss_func,
)

from tests.hf_reference import (  # noqa: E402
    ENTROPY_COEF,
    bar,
    make_config,
    num_response_tokens,
    pack,
)
from tests.unit.test_hf_router_replay import hand_forced, random_experts  # noqa: E402
from unirl.core.config.model_shape import moe_shape  # noqa: E402
from unirl.core.config.sections.algorithm import AlgorithmConfig  # noqa: E402
from unirl.core.config.sections.rollout import RolloutConfig  # noqa: E402
from unirl.core.data.routed_experts import FREE  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402
from unirl.core.maths.losses import Metric, reduce_metrics  # noqa: E402
from unirl.core.moe_loss import RouterLossSettings, router_term  # noqa: E402

VOCAB = 64
EXPERTS, TOP_K, LAYERS = 8, 2, 2
MOE_HF = dict(
    model_type="qwen3_moe",
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    norm_topk_prob=True,
    max_position_embeddings=64,
)
AUX, Z = 0.3, 0.05  # large enough to move the gradient visibly
SHAPES = [(2, 4), (3, 5), (2, 1), (4, 6)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE saved with plain transformers; decisive routers (HF's init gives
    near-uniform probabilities, where a rounding difference could flip a top-k choice)."""
    folder = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**MOE_HF)
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return folder


def sequences(seed: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (p + r,), generator=g).tolist(), p) for p, r in SHAPES]


def config(folder: Path, backend: str, checkpointing: bool = False, **algorithm):
    over: dict = {"model": {"gradient_checkpointing": checkpointing}}
    if backend == "fsdp2":
        from unirl.backends.fsdp2.plugin import Fsdp2Options

        over.update(backend="fsdp2", backend_options=Fsdp2Options())
    algo = AlgorithmConfig(router_aux_loss_coef=AUX, router_z_loss_coef=Z, **algorithm)
    if algo.routing_replay == "rollout":  # an engine's experts: rollouts from a file
        over["rollout"] = RolloutConfig(source="file", file="r3.jsonl")
    return make_config(folder, algorithm=algo, **over)


def build(cfg):
    from unirl.backends import build_backend

    return build_backend(cfg, total_optimizer_steps=5)


def reference_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    )


def seq_logprobs(model, ids: list[int]):
    """(log-probs [len-1], entropy [len-1], router logits per layer) of one sequence."""
    x = torch.tensor(ids)[None]
    out = model(input_ids=x, output_router_logits=True)
    logp_all = torch.log_softmax(out.logits[0].float(), dim=-1)
    logp = logp_all[:-1].gather(-1, x[0, 1:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)[:-1]
    return logp, entropy, out.router_logits


def reference_step(folder: Path, microbatches, *, lr=1e-2, clip=0.5, weight_decay=0.1):
    """Per-sequence transformers forwards: the policy term (token-mean NLL minus the entropy
    bonus), each microbatch's router term ``(AUX * aux + Z * z) * n_m / N`` with transformers'
    ``load_balancing_loss_func`` over the microbatch's tokens and ``z = mean logsumexp^2``; the
    AdamW step. Returns (grad norm before clipping, new params, aux and z token-weighted)."""
    model = reference_model(folder)
    n_resp = sum(num_response_tokens(mb) for mb in microbatches)
    n_tok = sum(len(ids) for mb in microbatches for ids, _ in mb)
    total, aux_mean, z_mean = 0.0, 0.0, 0.0
    for mb in microbatches:
        per_layer: list[list[torch.Tensor]] = [[] for _ in range(LAYERS)]
        n_m = sum(len(ids) for ids, _ in mb)
        for ids, prompt in mb:
            logp, entropy, router_logits = seq_logprobs(model, ids)
            valid = torch.tensor([1.0 if t + 1 >= prompt else 0.0 for t in range(len(ids) - 1)])
            total = (
                total + (-(logp * valid).sum() - ENTROPY_COEF * (entropy * valid).sum()) / n_resp
            )
            for layer, lg in enumerate(router_logits):
                per_layer[layer].append(lg)
        logits = tuple(torch.cat(rows) for rows in per_layer)
        aux = load_balancing_loss_func(logits, EXPERTS, TOP_K)
        rows = torch.cat(logits)
        z = (torch.logsumexp(rows, dim=-1) ** 2).mean()
        total = total + (AUX * aux + Z * z) * n_m / n_tok
        aux_mean += float(aux.detach()) * n_m / n_tok
        z_mean += float(z.detach()) * n_m / n_tok
    total.backward()
    params = list(model.parameters())
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))
    torch.nn.utils.clip_grad_norm_(params, clip)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8).step()
    new = {k: v.detach().clone() for k, v in model.named_parameters()}
    return norm, new, aux_mean, z_mean


def moe_loss_fn(cfg, global_resp: int, global_tokens: int, seen: list | None = None):
    """The test's policy term plus core's router term, as `RLStep` adds it."""
    settings = RouterLossSettings.from_config(cfg, moe_shape(cfg.model))

    def loss_fn(mb, logprobs, entropy, /, *, router_logits=None):
        assert router_logits is not None, "a MoE backend hands the router logits"
        if seen is not None:
            seen.append(logprobs.detach().clone())
        nll = -(logprobs * mb.loss_mask).sum()
        ent = (entropy * mb.loss_mask).sum()
        loss = (nll - ENTROPY_COEF * ent) / global_resp
        term = router_term(router_logits, mb, settings, global_tokens=global_tokens)
        nll_metric = Metric(numerator=nll.detach(), denominator=mb.loss_mask.sum(), kind="tokens")
        return loss + term.loss, {"nll": nll_metric, **term.metrics}

    return loss_fn


def full_params(backend) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in backend.model.named_parameters():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        out[k] = full.detach().clone()
    return out


def train(backend, cfg, mbs, seqs_per_mb, seen=None):
    resp = sum(num_response_tokens(s) for s in seqs_per_mb)
    tokens = sum(mb.num_tokens for mb in mbs)
    with bar(backend, len(mbs)) as progress:
        metrics = backend.forward_backward(
            mbs,
            loss_fn=moe_loss_fn(cfg, resp, tokens, seen),
            # the training pass replays (R2 and R3) whenever routing replay is on
            spec=LogprobSpec(
                with_entropy=True,
                entropy_grad=True,
                routing="off" if cfg.algorithm.routing_replay == "off" else "replay",
            ),
            progress=progress,
        )
    return reduce_metrics(metrics), backend.optimizer_step()


@pytest.mark.parametrize(
    ("backend_name", "checkpointing"),
    [("deepspeed", False), ("fsdp2", False), ("deepspeed", True)],
    ids=["deepspeed", "fsdp2", "deepspeed-checkpointing"],
)
def test_moe_step_with_router_losses_matches_transformers(moe_folder, backend_name, checkpointing):
    """With activation checkpointing the recomputed layers must not add their router logits
    twice, and the router logits' gradient must still flow."""
    seqs = sequences(1)
    split = [seqs[:2], seqs[2:]]
    cfg = config(moe_folder, backend_name, checkpointing)
    backend = build(cfg)
    try:
        ref = reference_model(moe_folder)
        with bar(backend, 1) as progress:
            (logp,) = backend.forward_logprobs(
                [pack(seqs)], role="policy", spec=LogprobSpec(), progress=progress
            )
        start = 0
        for ids, _ in seqs:
            expected = seq_logprobs(ref, ids)[0]
            torch.testing.assert_close(
                logp[start : start + len(ids) - 1], expected.detach(), atol=1e-5, rtol=0
            )
            start += len(ids)
        metrics, stats = train(backend, cfg, [pack(s) for s in split], split)
        norm, new, aux, z = reference_step(moe_folder, split)
        assert metrics["router/aux_loss"] == pytest.approx(aux, rel=1e-5)
        assert metrics["router/z_loss"] == pytest.approx(z, rel=1e-5)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-4)
        got = full_params(backend)
        # AdamW's first step is lr * g / (|g| + eps): an entry whose gradient is near eps (1e-8)
        # moves by a fraction of lr that rounding shifts; a wrong gradient moves it by ~lr (1e-2)
        for name, value in new.items():
            torch.testing.assert_close(got[name], value, atol=5e-5, rtol=1e-5, msg=name)
    finally:
        backend.close()


def test_router_terms_move_the_gradient(moe_folder):
    """Sanity of the reference itself: the router coefficients change the gradient norm (so the
    comparison above checks the router terms' gradient, not only the policy term's)."""
    seqs = sequences(1)
    split = [seqs[:2], seqs[2:]]
    with_router = reference_step(moe_folder, split)[0]
    global AUX, Z
    saved = AUX, Z
    AUX, Z = 0.0, 0.0
    try:
        without = reference_step(moe_folder, split)[0]
    finally:
        AUX, Z = saved
    assert abs(with_router - without) > 1e-3 * without


def forced_packed(seqs, seed: int):
    """A packed microbatch with random experts at every position but each sequence's last
    (FREE, as `pack_routed_experts` lays them out), and the per-sequence forced rows."""
    mb = pack(seqs)
    experts = random_experts(mb.num_tokens, LAYERS, EXPERTS, TOP_K, seed)
    last = mb.cu_seqlens[1:].long() - 1
    experts[last] = FREE
    return mb.with_fields(routed_experts=experts), experts


def forced_reference(model, seqs, experts):
    """Per sequence, the log-probs of the hand-forced forward at ``experts`` (packed rows)."""
    out, start = [], 0
    for ids, _ in seqs:
        ref, _ = hand_forced(model, experts[start : start + len(ids)])
        x = torch.tensor(ids)
        logits = ref(input_ids=x[None], use_cache=False).logits[0]
        out.append(torch.log_softmax(logits[:-1].double(), -1).gather(1, x[1:, None])[:, 0])
        start += len(ids)
    return torch.cat([torch.cat([o.float(), o.new_zeros(1).float()]) for o in out])


def without_last(values, seqs):
    keep = torch.ones(values.numel(), dtype=torch.bool)
    keep[torch.tensor([sum(len(i) for i, _ in seqs[: k + 1]) - 1 for k in range(len(seqs))])] = (
        False
    )
    return values[keep]


@pytest.mark.parametrize("backend_name", ["deepspeed", "fsdp2"])
def test_rollout_replay_equals_the_hand_forced_forward(moe_folder, backend_name):
    """FSDP2 with activation checkpointing: replay must hold in the recomputed forward."""
    seqs = sequences(2)
    cfg = config(moe_folder, backend_name, backend_name == "fsdp2", routing_replay="rollout")
    backend = build(cfg)
    try:
        mb, experts = forced_packed(seqs, seed=5)
        expected = forced_reference(reference_model(moe_folder), seqs, experts)
        with bar(backend, 1) as progress:
            (logp,) = backend.forward_logprobs(
                [mb], role="policy", spec=LogprobSpec(routing="replay"), progress=progress
            )
        torch.testing.assert_close(
            without_last(logp, seqs), without_last(expected, seqs), atol=1e-5, rtol=0
        )
        seen: list[torch.Tensor] = []
        metrics, _ = train(backend, cfg, [mb], [seqs], seen)
        torch.testing.assert_close(
            without_last(seen[0], seqs), without_last(expected, seqs), atol=1e-5, rtol=0
        )
        # random experts disagree with the free top-k almost everywhere
        assert 0.5 < metrics["router/disagreement"] <= 1.0
    finally:
        backend.close()


def test_record_then_replay_after_the_router_changed(moe_folder):
    """R2 on DeepSpeed: the forward-only pass records the routers' own top-k (transformers'
    router outputs); the routers then change; the training forward replaying the recording equals
    the hand-forced forward of the changed model at the recorded experts."""
    seqs = sequences(3)
    cfg = config(moe_folder, "deepspeed", routing_replay="record")
    backend = build(cfg)
    try:
        mb = pack(seqs)
        with bar(backend, 1) as progress:
            spec = LogprobSpec(routing="record")
            backend.forward_logprobs([mb], role="policy", spec=spec, progress=progress)
        (recorded,) = backend.recorded_routing()
        ref = reference_model(moe_folder)
        free = []
        for ids, _ in seqs:
            out = ref(input_ids=torch.tensor(ids)[None], output_router_logits=True)
            free.append(torch.stack([lg.topk(TOP_K, -1).indices for lg in out.router_logits], 1))
        torch.testing.assert_close(
            recorded.sort(-1).values, torch.cat(free).sort(-1).values.to(recorded.dtype)
        )
        with torch.no_grad():  # the routers change (as an optimizer step would change them)
            g = torch.Generator().manual_seed(9)
            for m_backend, m_ref in zip(backend.model.model.layers, ref.model.layers):
                noise = torch.randn(m_ref.mlp.gate.weight.shape, generator=g)
                m_backend.mlp.gate.weight.add_(noise)
                m_ref.mlp.gate.weight.add_(noise)
        replay = recorded.clone()
        replay[mb.cu_seqlens[1:].long() - 1] = FREE
        expected = forced_reference(ref, seqs, replay)
        seen: list[torch.Tensor] = []
        metrics, _ = train(backend, cfg, [mb.with_fields(routed_experts=replay)], [seqs], seen)
        torch.testing.assert_close(
            without_last(seen[0], seqs), without_last(expected, seqs), atol=1e-5, rtol=0
        )
        assert metrics["router/disagreement"] > 0.0  # the changed routers would choose otherwise
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_moe_forward_and_router_logits_on_gpu_bf16(moe_folder):
    """The GPU path of the packed forward (varlen flash attention, bf16) on Qwen3-MoE against
    per-sequence eager forwards in bf16, and the router logits the capture hands core."""
    from unirl.backends.hf.moe import PolicyRouting
    from unirl.backends.hf.packed import forward_packed, use_packed_attention

    device = torch.device("cuda")
    model = transformers.AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.bfloat16)
    model.to(device).eval()
    ref = reference_model(moe_folder).to(device=device, dtype=torch.bfloat16).eval()
    use_packed_attention(model)
    routing = PolicyRouting(model)  # routing "off" until a pass begins another
    seqs = sequences(4)
    mb = pack(seqs)
    with torch.no_grad(), routing.training(mb):
        logits = forward_packed(model, mb, device).float()
        router_logits = routing.take_router_logits()
    assert [tuple(lg.shape) for lg in router_logits] == [(mb.num_tokens, EXPERTS)] * LAYERS
    start = 0
    for ids, _ in seqs:
        with torch.no_grad():
            out = ref(input_ids=torch.tensor(ids, device=device)[None], output_router_logits=True)
        n = len(ids)
        torch.testing.assert_close(
            logits[start : start + n], out.logits[0].float(), atol=5e-2, rtol=5e-2
        )
        for got, want in zip(router_logits, out.router_logits):
            torch.testing.assert_close(
                got[start : start + n].float(), want.float(), atol=5e-2, rtol=5e-2
            )
        start += n
