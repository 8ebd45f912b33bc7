"""The RL step under ``routing_replay: rollout`` on the test suite's toy backend (declared as
replaying): each rollout is checked for ``routed_experts`` before any forward, and every forward's
microbatches carry the experts of their own tokens; with replay off, experts in the data do not
reach the backend."""

from __future__ import annotations

import attrs
import pytest
import torch

from tests.plugins import toy_backend
from unirl.core.config.run_config import config_from_dict
from unirl.core.data.rollout import RolloutBatch
from unirl.core.data.routed_experts import FREE
from unirl.core.errors import RolloutDataError
from unirl.core.protocols.backend_plugin import BACKENDS, build_backend
from unirl.core.step import RLStep

VOCAB = 8
HF = {
    "model_type": "qwen3_moe",
    "vocab_size": VOCAB,
    "num_hidden_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
SAMPLES = [([1, 2], [3, 4, 5], 1.0, 0), ([1, 2], [6, 7], 0.0, 0)]


def row(token: int) -> list[list[int]]:
    """The experts written for a token (both layers): a function of the token, so that a
    microbatch position can be checked against the token it holds."""
    return [[token, (token + 1) % 8]] * 2


@pytest.fixture
def toy_replaying():
    with BACKENDS.scoped():
        BACKENDS.register("toy", attrs.evolve(toy_backend.PLUGIN, supports_routing_replay=True))
        yield


def setup(mode: str, with_experts: bool):
    cfg = config_from_dict(
        {
            "backend": "toy",
            "model": {"hf_config": HF, "init_seed": 3, "max_seq_len": 16},
            "batch": {
                "prompts_per_rollout": 1,
                "samples_per_prompt": 2,
                "samples_per_optimizer_step": 2,
                "micro_batch_size": 1,
            },
            "parallel": {"world_size": 1},
            "algorithm": {"routing_replay": mode, "std_normalize": False},
            "rollout": {"max_new_tokens": 8}
            if mode != "rollout"
            else {"max_new_tokens": 8, "source": "file", "file": "r3.jsonl"},
            "progress": {"enabled": False},
        }
    )
    records = []
    for p, r, w, g in SAMPLES:
        rec = {"prompt_tokens": p, "response_tokens": r, "reward": w, "group_id": g}
        if with_experts:
            rec["routed_experts"] = [row(t) for t in (p + r)[:-1]]
        records.append(rec)
    backend = build_backend(cfg, total_optimizer_steps=1)
    seen = []
    train = backend.forward_backward

    def capture(mbs, **kw):
        seen.extend(mbs)
        return train(mbs, **kw)

    backend.forward_backward = capture  # type: ignore[method-assign]
    return cfg, backend, RolloutBatch.from_records(records), seen


def test_rollout_mode_hands_each_forward_the_experts_of_its_tokens(toy_replaying):
    cfg, backend, batch, seen = setup("rollout", with_experts=True)
    RLStep(cfg, backend).run(batch)
    assert len(seen) == 2
    for mb in seen:
        assert mb.routed_experts.shape == (mb.num_tokens, 2, 2)
        last = mb.cu_seqlens[1:].long() - 1
        for pos, token in enumerate(mb.tokens.tolist()):
            want = [[FREE, FREE]] * 2 if pos in last.tolist() else row(token)
            assert mb.routed_experts[pos].tolist() == want


def test_rollout_mode_refuses_a_rollout_without_experts_before_any_forward(toy_replaying):
    cfg, backend, batch, seen = setup("rollout", with_experts=False)
    with pytest.raises(RolloutDataError, match=r"sample 0: field 'routed_experts' is missing"):
        RLStep(cfg, backend).run(batch)
    assert seen == [] and backend.forward_calls == {"policy": 0, "reference": 0}


def test_with_replay_off_experts_in_the_data_do_not_reach_the_backend(toy_replaying):
    cfg, backend, batch, seen = setup("off", with_experts=True)
    RLStep(cfg, backend).run(batch)
    assert seen and all(mb.routed_experts is None for mb in seen)


def test_record_mode_trains_on_the_experts_the_forward_only_pass_recorded(toy_replaying):
    """R2 in the step: the toy backend 'records' ``row(token)`` at every position of its policy
    forward-only microbatches (as a router would, its last position too); the training passes
    (two epochs, the second in another order) get each token's recorded row, the last position of
    each sequence FREE; experts in the data are not what is trained on."""
    cfg, backend, batch, seen = setup("record", with_experts=True)
    cfg = attrs.evolve(cfg, batch=attrs.evolve(cfg.batch, epochs_per_rollout=2))
    forward = backend.forward_logprobs
    recorded: list = []

    def forward_logprobs(mbs, **kw):
        if kw["role"] == "policy":
            recorded[:] = [
                torch.tensor([[[(t + 3) % 8, (t + 4) % 8]] * 2 for t in mb.tokens.tolist()])
                for mb in mbs
            ]
        return forward(mbs, **kw)

    backend.forward_logprobs = forward_logprobs  # type: ignore[method-assign]
    backend.recorded_routing = lambda: [e.to(torch.int32) for e in recorded]  # type: ignore[attr-defined]
    RLStep(cfg, backend).run(batch)
    assert len(seen) == 4  # 2 epochs x 2 microbatches
    for mb in seen:
        last = mb.cu_seqlens[1:].long() - 1
        for pos, token in enumerate(mb.tokens.tolist()):
            want = (
                [[FREE, FREE]] * 2
                if pos in last.tolist()
                else [[(token + 3) % 8, (token + 4) % 8]] * 2
            )
            assert mb.routed_experts[pos].tolist() == want


def test_record_mode_needs_a_backend_that_hands_back_recordings(toy_replaying):
    from unirl.core.errors import ConfigError

    cfg, backend, batch, _ = setup("record", with_experts=False)
    with pytest.raises(ConfigError, match=r"does not hand back recorded routing"):
        RLStep(cfg, backend).run(batch)


@pytest.mark.parametrize(
    ("mode", "forward_only", "training"),
    [("off", "off", "off"), ("rollout", "replay", "replay"), ("record", "record", "replay")],
)
def test_each_pass_carries_the_routing_core_decided(toy_replaying, mode, forward_only, training):
    """The backends read routing replay from the passes' specs, never from the config: the
    policy's forward-only pass records (R2) or replays (R3), every training pass replays when
    replay is on."""
    cfg, backend, batch, _ = setup(mode, with_experts=True)
    cfg = attrs.evolve(cfg, old_logprobs="recompute")  # a forward-only pass in every mode
    passes: list[tuple[str, str]] = []
    forward, train = backend.forward_logprobs, backend.forward_backward

    def forward_logprobs(mbs, **kw):
        passes.append((kw["role"], kw["spec"].routing))
        return forward(mbs, **kw)

    def forward_backward(mbs, **kw):
        passes.append(("train", kw["spec"].routing))
        return train(mbs, **kw)

    backend.forward_logprobs = forward_logprobs  # type: ignore[method-assign]
    backend.forward_backward = forward_backward  # type: ignore[method-assign]
    backend.recorded_routing = lambda: [  # type: ignore[attr-defined]
        torch.zeros(mb.num_tokens, 2, 2, dtype=torch.int32) for mb in recorded_for
    ]
    recorded_for = [batch.pack([0]), batch.pack([1])]
    RLStep(cfg, backend).run(batch)
    assert passes == [("policy", forward_only), ("train", training)]
