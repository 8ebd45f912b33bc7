"""The Hugging Face router hook (`unirl.backends.hf.router_replay`) against a forward written here:
Qwen3-MoE's sparse blocks computed by hand from forced experts (softmax of the router logits
gathered at the forced indices, renormalised as ``norm_topk_prob`` says, each expert's SwiGLU
from the fused weights), fp32."""

from __future__ import annotations

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from tests.unit.replay_fixtures import MOE_HF  # noqa: E402
from unirl.backends.hf.router_replay import RouterReplay  # noqa: E402
from unirl.core.data.routed_experts import FREE  # noqa: E402
from unirl.core.errors import LossInputError  # noqa: E402

T = 11  # tokens of the packed [1, T] stream


def tiny_model(norm_topk_prob: bool, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    hf = {k: v for k, v in MOE_HF.items() if k != "model_type"}
    cfg = Qwen3MoeConfig(**{**hf, "norm_topk_prob": norm_topk_prob}, attn_implementation="eager")
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # decisive routers: HF's init gives near-uniform probabilities
        for block in sparse_blocks(model):
            block.gate.weight.normal_(0.0, 1.0)
    return model


def sparse_blocks(model: Qwen3MoeForCausalLM) -> list[Qwen3MoeSparseMoeBlock]:
    return [
        layer.mlp for layer in model.model.layers if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)
    ]


def hand_forced(model: Qwen3MoeForCausalLM, forced_tlk: torch.Tensor) -> tuple[object, list[int]]:
    """A copy of ``model`` whose sparse blocks route to ``forced_tlk`` (FREE rows: the block's own
    top-k), computed by hand; returns it and a list that collects, per layer, how many tokens'
    free top-k sets differ from the forced ones."""
    ref = copy.deepcopy(model)
    differing: list[int] = []

    def make_forward(layer: int):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            b, s, h = hidden_states.shape
            x = hidden_states.reshape(-1, h)
            logits = x @ self.gate.weight.T
            probs = torch.softmax(logits.double(), dim=-1).float()
            k = self.gate.top_k
            free = probs.topk(k, dim=-1).indices
            forced = forced_tlk[:, layer, :].long().clone()
            count = 0
            for t in range(forced.shape[0]):
                if forced[t, 0] == FREE:
                    forced[t] = free[t]
                elif set(forced[t].tolist()) != set(free[t].tolist()):
                    count += 1
            differing.append(count)
            w = probs.gather(1, forced)
            if self.gate.norm_topk_prob:
                w = w / w.sum(dim=-1, keepdim=True)
            out = torch.zeros_like(x)
            for slot in range(k):
                gate_up = self.experts.gate_up_proj[forced[:, slot]]  # [N, 2I, H]
                down = self.experts.down_proj[forced[:, slot]]  # [N, H, I]
                g, u = torch.einsum("nih,nh->ni", gate_up, x).chunk(2, dim=-1)
                y = torch.einsum("nhi,ni->nh", down, torch.nn.functional.silu(g) * u)
                out = out + w[:, slot : slot + 1] * y
            return out.reshape(b, s, h)

        return forward

    for layer, block in enumerate(sparse_blocks(ref)):
        block.forward = types.MethodType(make_forward(layer), block)
    return ref, differing


def token_logprobs(model: object, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[None], use_cache=False).logits[0]
    return torch.log_softmax(logits[:-1].double(), -1).gather(1, tokens[1:, None])[:, 0]


def random_experts(n: int, layers: int, experts: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :k].to(torch.int32)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_logprobs_and_router_gradients_equal_a_hand_forced_forward(norm_topk_prob):
    model = tiny_model(norm_topk_prob)
    tokens = torch.randint(
        0, MOE_HF["vocab_size"], (T,), generator=torch.Generator().manual_seed(1)
    )
    forced = random_experts(T, 2, MOE_HF["num_experts"], MOE_HF["num_experts_per_tok"], seed=2)
    forced[4, 1] = FREE  # one token-layer left to the router
    ref, ref_differing = hand_forced(model, forced)

    replay = RouterReplay(model)
    assert replay.num_moe_layers == 2  # layer 1 is dense (mlp_only_layers)
    with replay.replaying(forced):
        got = token_logprobs(model, tokens)
        got.sum().backward()
    want = token_logprobs(ref, tokens)
    want.sum().backward()

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for block, ref_block in zip(sparse_blocks(model), sparse_blocks(ref)):
        grad = block.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0  # the router keeps its gradient
        torch.testing.assert_close(grad, ref_block.gate.weight.grad, rtol=1e-4, atol=1e-6)
    metric = replay.disagreement_metric()
    decisions = 2 * T - 1  # the FREE token-layer is not a replayed decision
    assert float(metric.denominator) == decisions
    assert float(metric.numerator) == sum(ref_differing) > 0  # random experts disagree


def test_record_then_replay_reproduces_the_recorded_forward_exactly():
    model = tiny_model(norm_topk_prob=True)
    tokens = torch.randint(
        0, MOE_HF["vocab_size"], (T,), generator=torch.Generator().manual_seed(3)
    )
    replay = RouterReplay(model)
    with torch.no_grad(), replay.recording():
        free = model(input_ids=tokens[None]).logits
    recorded = replay.recorded()
    assert recorded.shape == (T, 2, MOE_HF["num_experts_per_tok"])
    assert recorded.dtype == torch.int32
    with torch.no_grad(), replay.replaying(recorded):
        again = model(input_ids=tokens[None]).logits
    assert torch.equal(again, free)
    metric = replay.disagreement_metric()
    assert float(metric.numerator) == 0 and float(metric.denominator) == 2 * T
    # the recorded experts are the HF router's own top-k, written here
    with torch.no_grad():
        captured = {}
        for i, block in enumerate(sparse_blocks(model)):
            block.gate.register_forward_hook(
                lambda m, a, out, i=i: captured.__setitem__(
                    i, torch.softmax(out[0], -1).topk(m.top_k, -1).indices
                )
            )
        model(input_ids=tokens[None])
    for i in range(2):
        assert torch.equal(recorded[:, i].long(), captured[i])


def test_outside_its_scopes_the_hook_changes_nothing():
    model = tiny_model(norm_topk_prob=False)
    tokens = torch.arange(T) % MOE_HF["vocab_size"]
    with torch.no_grad():
        before = model(input_ids=tokens[None]).logits
        replay = RouterReplay(model)
        with replay.replaying(random_experts(T, 2, 6, 2, seed=5)):
            model(input_ids=tokens[None])
        after = model(input_ids=tokens[None]).logits
    assert torch.equal(before, after)


def test_replay_holds_through_gradient_checkpointing():
    """A checkpointed layer recomputes its forward in backward: inside `replaying` the recompute
    replays too, so the gradients equal those without checkpointing."""
    forced = random_experts(T, 2, 6, 2, seed=7)
    tokens = torch.arange(T) % MOE_HF["vocab_size"]
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(norm_topk_prob=True)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        replay = RouterReplay(model)
        with replay.replaying(forced):
            token_logprobs(model, tokens).sum().backward()
        grads.append([b.gate.weight.grad.clone() for b in sparse_blocks(model)])
    for plain, ckpt in zip(*grads):
        torch.testing.assert_close(ckpt, plain, rtol=1e-5, atol=1e-7)


def test_wrong_shapes_are_refused_naming_the_layout():
    model = tiny_model(norm_topk_prob=True)
    replay = RouterReplay(model)
    empty = replay.disagreement_metric()  # no replayed forward (an empty microbatch): 0 of 0
    assert (float(empty.numerator), float(empty.denominator)) == (0.0, 0.0)
    with (
        pytest.raises(LossInputError, match=r"2 MoE layers and top_k=2; give \[tokens, 2, 2\]"),
        replay.replaying(torch.zeros(T, 3, 2, dtype=torch.int32)),
    ):
        pass
    with (
        pytest.raises(LossInputError, match=r"routes 11 tokens but routed_experts has 5 rows"),
        torch.no_grad(),
        replay.replaying(random_experts(5, 2, 6, 2, seed=0)),
    ):
        model(input_ids=torch.arange(T)[None])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_on_cuda_matches_the_hand_forced_forward(dtype):
    """The hook on the GPU (the fused experts' CUDA path, bf16 routing weights) against the fp32
    hand-forced forward on the CPU."""
    model = tiny_model(norm_topk_prob=True)
    tokens = torch.randint(
        0, MOE_HF["vocab_size"], (T,), generator=torch.Generator().manual_seed(1)
    )
    forced = random_experts(T, 2, MOE_HF["num_experts"], MOE_HF["num_experts_per_tok"], seed=2)
    ref, _ = hand_forced(model, forced)
    with torch.no_grad():
        want = token_logprobs(ref, tokens)
    gpu = copy.deepcopy(model).to("cuda", dtype)
    replay = RouterReplay(gpu)
    with replay.replaying(forced.cuda()):
        got = token_logprobs(gpu, tokens.cuda())
        got.sum().backward()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)
    assert all(b.gate.weight.grad.abs().sum() > 0 for b in sparse_blocks(gpu))
