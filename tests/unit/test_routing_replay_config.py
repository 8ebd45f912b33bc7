"""``algorithm.routing_replay``: the MoE shape probe against the transformers model it describes,
the config rules, what `unirl check` says, and the ``router/disagreement`` metric by hand."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_models import TINY_BATCH
from tests.unit.replay_fixtures import MOE_HF, REPLAY_BACKEND, replay_backend
from unirl.core.config.model_shape import moe_shape
from unirl.core.config.routing_replay import replay_shape
from unirl.core.config.run_config import config_from_dict
from unirl.core.config.sections.model import ModelConfig
from unirl.core.errors import ConfigError
from unirl.core.maths.losses import reduce_metrics
from unirl.core.maths.losses.router_disagreement import (
    router_disagreement_metric,
    routing_disagreement,
)
from unirl.core.protocols.backend_plugin import BACKENDS


def cfg_dict(mode: str = "record", hf: dict | None = None, **top) -> dict:
    return {
        "backend": REPLAY_BACKEND,
        "model": {"hf_config": dict(MOE_HF if hf is None else hf)},
        "batch": dict(TINY_BATCH),
        "parallel": {"world_size": 1},
        "algorithm": {"routing_replay": mode},
        # R3 replays an engine's experts: rollouts from a file (the sampler records none)
        **({"rollout": {"source": "file", "file": "r3.jsonl"}} if mode == "rollout" else {}),
        **top,
    }


@pytest.fixture(autouse=True)
def _replay_backend():
    with replay_backend():
        yield


# -- the probe -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"mlp_only_layers": [], "decoder_sparse_step": 2, "num_hidden_layers": 4},
        {"mlp_only_layers": [0, 3], "num_hidden_layers": 4, "norm_topk_prob": False},
    ],
)
def test_probe_agrees_with_the_transformers_model(extra):
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = {**MOE_HF, **extra}
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    )
    sparse = tuple(
        i
        for i, layer in enumerate(model.model.layers)
        if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)
    )
    shape = moe_shape(ModelConfig(hf_config=hf))
    assert shape is not None and shape.moe_layers == sparse
    gate = model.model.layers[sparse[0]].mlp.gate
    assert (shape.num_experts, shape.top_k, shape.norm_topk_prob) == (
        gate.num_experts,
        gate.top_k,
        gate.norm_topk_prob,
    )


def test_probe_reads_hugging_face_defaults_and_config_json(tmp_path):
    transformers = pytest.importorskip("transformers")
    defaults = transformers.Qwen3MoeConfig()
    shape = moe_shape(ModelConfig(hf_config={"model_type": "qwen3_moe"}))
    assert shape is not None
    assert shape.num_experts == defaults.num_experts
    assert shape.top_k == defaults.num_experts_per_tok
    assert shape.num_moe_layers == defaults.num_hidden_layers
    assert shape.norm_topk_prob == defaults.norm_topk_prob
    (tmp_path / "config.json").write_text(json.dumps(MOE_HF))
    assert moe_shape(ModelConfig(path=str(tmp_path))) == moe_shape(ModelConfig(hf_config=MOE_HF))
    assert moe_shape(ModelConfig(hf_config={"model_type": "llama"})) is None
    with pytest.raises(ConfigError, match=r"cannot read the model's Hugging Face config"):
        moe_shape(ModelConfig(path=str(tmp_path / "missing")))


def test_probe_reads_a_folder_transformers_saved(tmp_path):
    """transformers 5 writes ``num_experts`` as ``num_local_experts`` in config.json."""
    transformers = pytest.importorskip("transformers")
    hf = {k: v for k, v in MOE_HF.items() if k != "model_type"}
    transformers.Qwen3MoeConfig(**hf).save_pretrained(tmp_path)
    assert moe_shape(ModelConfig(path=str(tmp_path))) == moe_shape(ModelConfig(hf_config=MOE_HF))


# -- config rules ----------------------------------------------------------------------------


def test_default_is_off_and_a_moe_config_loads():
    assert (
        config_from_dict(cfg_dict("off", hf={"model_type": "llama"})).algorithm.routing_replay
        == "off"
    )
    cfg = config_from_dict(cfg_dict("rollout"))
    shape = replay_shape(cfg)
    assert shape is not None and (shape.num_moe_layers, shape.top_k, shape.num_experts) == (2, 2, 6)


def test_replay_on_a_dense_model_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"algorithm.routing_replay='rollout' needs a mixture-of-experts model .* "
        r"model_type='llama' has no MoE layer",
    ):
        config_from_dict(cfg_dict("rollout", hf={"model_type": "llama"}))


def test_record_with_rollout_old_logprobs_is_refused():
    with pytest.raises(
        ConfigError, match=r"records each token's experts in the old-log-prob forward"
    ):
        config_from_dict(cfg_dict("record", old_logprobs="rollout"))
    config_from_dict(cfg_dict("rollout", old_logprobs="rollout"))  # R3 needs no forward-only pass


def test_a_backend_that_does_not_replay_is_refused():
    from tests.plugins import toy_backend

    with BACKENDS.scoped():
        BACKENDS.register("toy", toy_backend.PLUGIN)  # declares no routing replay
        with pytest.raises(ConfigError, match=r"backend: toy does not replay MoE routing yet"):
            config_from_dict({**cfg_dict("record"), "backend": "toy"})


def test_deepspeed_and_fsdp2_replay():
    assert BACKENDS.get("deepspeed").supports_routing_replay
    assert BACKENDS.get("fsdp2").supports_routing_replay


def test_unirl_check_prints_the_need_with_its_reason():
    from unirl.cli import check_report

    report = check_report(config_from_dict(cfg_dict("record")))
    text = report["old_logprobs"]["explanation"]
    assert "old log-probs: recompute (requested: auto)" in text
    assert (
        "routing_replay: algorithm.routing_replay=record: the old-log-prob forward records" in text
    )
    report = check_report(config_from_dict(cfg_dict("rollout")))
    assert report["old_logprobs"]["source"] == "reuse"


# -- the metric --------------------------------------------------------------------------------


def test_disagreement_counts_sets_and_skips_free_rows():
    free = torch.tensor([[0, 1], [2, 3], [1, 0], [4, 5]])
    given = torch.tensor([[1, 0], [2, 4], [-1, -1], [4, 5]])
    # row 0: same set in another order -> agree; row 1: {2,3} vs {2,4} -> differ; row 2: FREE
    differing, decisions = routing_disagreement(free, given)
    assert (int(differing), int(decisions)) == (1, 3)


def test_disagreement_reduces_over_decisions_not_microbatches():
    # microbatch A: 1 of 3 decisions differ; microbatch B: 3 of 5 -> (1 + 3) / (3 + 5) = 0.5
    a = router_disagreement_metric(torch.tensor(1), torch.tensor(3))
    b = router_disagreement_metric(torch.tensor(3), torch.tensor(5))
    got = reduce_metrics([{"router/disagreement": a}, {"router/disagreement": b}])
    assert got["router/disagreement"] == pytest.approx(0.5)


def test_unquoted_off_in_yaml_reads_as_off(tmp_path):
    """YAML 1.1 reads ``routing_replay: off`` as false; it means "off"."""
    import yaml

    data = yaml.safe_load("algorithm:\n  routing_replay: off\n")
    assert data["algorithm"]["routing_replay"] is False
    cfg = config_from_dict({**cfg_dict("record"), "algorithm": data["algorithm"]})
    assert cfg.algorithm.routing_replay == "off"
