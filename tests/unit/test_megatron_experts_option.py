"""``megatron.experts: auto | grouped | sequential`` changes what is built, or is refused: with
Transformer Engine (simulated: TE's block spec stood in by the local one whose experts are a
marker module) ``auto`` keeps TE's experts and a forced value puts its module in TE's spec; on a
dense model a forced value is a ConfigError at build, and a warning at config check where the
model's config cannot be read beforehand."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs megatron-core and transformers (pip install unirl[megatron,hf])",
)

SHAPE = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # layer 0 dense, layer 1 sparse
    return Qwen3MoeConfig(
        **SHAPE, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0]
    )


class _Records(logging.Handler):
    """The messages of the records it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _te_spec_experts(rank, world, requested):
    """The MoE layer's module, its experts module and experts linears, and the log lines, of
    `moe_block_spec` with ``use_te=True`` where TE's block spec is the local one with a marker
    in place of TE's experts (the TE spec itself cannot be built without TE)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from unirl.backends.megatron import model
    from unirl.core.config.run_config import ParallelConfig

    class TEExpertsStandIn(torch.nn.Module):
        pass

    real = model.get_gpt_decoder_block_spec

    def te_block_spec(config, use_transformer_engine, **kwargs):
        assert use_transformer_engine
        block = real(config, use_transformer_engine=False, **kwargs)
        for spec in block.layer_specs:
            mlp = spec.submodules.mlp
            if isinstance(mlp, ModuleSpec) and mlp.module is MoELayer:
                mlp.submodules.experts = ModuleSpec(module=TEExpertsStandIn)
        return block

    model.get_gpt_decoder_block_spec = te_block_spec
    model._LOGGED_EXPERTS.clear()
    records = _Records()
    logging.getLogger(model.__name__).addHandler(records)
    logging.getLogger(model.__name__).setLevel(logging.INFO)
    ps.initialize_model_parallel(1, 1)
    config = model.transformer_config(_qwen3_moe(), ParallelConfig(), dtype=torch.float32)
    block = model.moe_block_spec(
        config, vp_stage=None, device=torch.device("cpu"), use_te=True, experts_module=requested
    )
    layers = []
    for spec in block.layer_specs:
        mlp = spec.submodules.mlp
        if isinstance(mlp, ModuleSpec) and issubclass(mlp.module, MoELayer):
            experts = mlp.submodules.experts
            linears = (
                getattr(experts.submodules, "linear_fc1", None),
                getattr(experts.submodules, "linear_fc2", None),
            )
            names = tuple(None if c is None else c.__name__ for c in linears)
            layers.append((mlp.module.__name__, experts.module.__name__, names))
    return layers, [m for m in records.messages if m.startswith("MoE experts")]


def test_te_auto_keeps_te_experts_and_says_so():
    [(layers, logged)] = run_distributed(_te_spec_experts, 1, "auto")
    assert layers == [("MoELayer", "TEExpertsStandIn", (None, None))]
    assert len(logged) == 1 and "Transformer Engine's" in logged[0], logged
    assert "megatron.experts: auto" in logged[0], logged


def test_te_forced_grouped_puts_grouped_experts_in_te_spec():
    [(layers, logged)] = run_distributed(_te_spec_experts, 1, "grouped")
    # the grouped experts on megatron's local linears, in the sync-free dispatcher's layer
    assert layers == [
        ("GroupedMoELayer", "GroupedExperts", ("ColumnParallelLinear", "RowParallelLinear"))
    ]
    assert len(logged) == 1, logged
    assert logged[0].startswith("MoE experts: grouped (megatron.experts: grouped"), logged
    assert "in place of Transformer Engine's" in logged[0], logged


def test_te_forced_sequential_puts_megatron_sequential_mlp_in_te_spec():
    [(layers, logged)] = run_distributed(_te_spec_experts, 1, "sequential")
    assert layers == [("MoELayer", "SequentialMLP", ("ColumnParallelLinear", "RowParallelLinear"))]
    assert len(logged) == 1, logged
    assert logged[0].startswith("MoE experts: sequential (megatron.experts: sequential"), logged
    assert "in place of Transformer Engine's" in logged[0], logged


@pytest.mark.parametrize("requested", ["grouped", "sequential"])
def test_dense_model_refuses_a_forced_experts_module_at_build(requested):
    from transformers import Qwen2Config

    from unirl.backends.megatron.model import build_gpt_model
    from unirl.core.config.run_config import ParallelConfig
    from unirl.core.errors import ConfigError

    # refused before anything is built: no parallel state needed to reach the error
    with pytest.raises(
        ConfigError,
        match=rf"megatron.experts='{requested}' chooses a mixture-of-experts model's experts "
        r"module; model_type='qwen2' is dense \(no experts\): remove megatron.experts or set it "
        r"to auto",
    ):
        build_gpt_model(
            Qwen2Config(**SHAPE),
            ParallelConfig(),
            dtype=torch.float32,
            pre_process=True,
            post_process=True,
            experts_module=requested,
        )


def test_the_build_check_passes_auto_and_moe_models():
    from transformers import Qwen2Config

    from unirl.backends.megatron.model import check_experts_option

    check_experts_option(Qwen2Config(**SHAPE), "auto")
    for requested in ("auto", "grouped", "sequential"):
        check_experts_option(_qwen3_moe(), requested)


def _megatron_config(tmp_path, experts):
    from tests.unit.test_config import base
    from unirl.core.config.run_config import config_from_dict

    data = base(backend="megatron", megatron={"experts": experts})
    data["model"] = {"path": str(tmp_path)}  # a folder without config.json
    return config_from_dict(data)


def test_check_warns_where_the_model_config_is_unreadable(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="unirl.backends.megatron.plugin"):
        cfg = _megatron_config(tmp_path, "grouped")
    assert cfg.backend_options.experts == "grouped"
    [record] = [r for r in caplog.records if r.name == "unirl.backends.megatron.plugin"]
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        f"megatron.experts='grouped': model.hf_config is unset and {tmp_path} has no readable "
        "config.json, so whether the model has experts is known only at build, which refuses "
        "the key on a dense model; set model.hf_config to check it now"
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unirl.backends.megatron.plugin"):
        _megatron_config(tmp_path, "auto")
    assert not [r for r in caplog.records if r.name == "unirl.backends.megatron.plugin"]


def test_check_refuses_a_dense_config_json(tmp_path):
    import json

    from unirl.core.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", **SHAPE}))
    with pytest.raises(ConfigError, match=r"megatron.experts='sequential' .* is dense"):
        _megatron_config(tmp_path, "sequential")
