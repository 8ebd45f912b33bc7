"""`unirl convert` between Hugging Face folders and Megatron weights folders, in a TP x PP x EP
layout (4 ranks on gloo: tp 2, pp 2, ep 2, etp 1, one sparse layer per stage).

In one group of processes: a tiny Qwen3-MoE Hugging Face folder (written here with every weight
random, a tokenizer file beside it) -> a Megatron weights folder for that layout -> a Hugging Face
folder again; and a Megatron run with that layout (``model.path`` = the weights folder) starts
from exactly the folder's weights. Compared with the tensors read straight from the original
safetensors file: bit for bit, dtype included, every name; the tokenizer file carried through.
"""

import importlib.util
import json
import shutil

import pytest
import torch

from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")
from safetensors.torch import load_file  # noqa: E402

from tests.distributed.test_megatron_moe_tp import HF_CONFIG, _hf_model  # noqa: E402

LAYOUT = {"tp": 2, "pp": 2, "vpp": None, "ep": 2, "etp": 1}


def _safetensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def _worker(rank, world_size, src, weights, back):
    from unirl.backends.megatron import build_backend
    from unirl.backends.megatron.weights_folder import MegatronWeights
    from unirl.convert import convert
    from unirl.core.config.run_config import ParallelConfig, config_from_dict
    from unirl.core.errors import ConfigError

    convert(src, weights, LAYOUT, None)
    convert(weights, back, dict.fromkeys(LAYOUT), None)
    cfg = config_from_dict(
        {
            "backend": "megatron",
            "model": {"path": weights, "max_seq_len": 16},
            "batch": dict(TINY_BATCH),
            "parallel": {**{k: v for k, v in LAYOUT.items() if v}, "sequence_parallel": True},
            "logging": {"tensorboard": False},
        },
        world_size=world_size,
    )
    backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=False)
    started = backend.hf_state_dict()
    backend.close()
    try:
        MegatronWeights(__import__("pathlib").Path(weights)).check_layout(ParallelConfig(tp=2))
        refusal = None
    except ConfigError as err:
        refusal = str(err)
    return {"started": started, "refusal": refusal}


def test_hf_megatron_layout_hf_is_exact_and_a_run_starts_from_it(tmp_path):
    src = tmp_path / "hf"
    model = _hf_model(seed=5)
    model.save_pretrained(src)  # per-expert names on disk
    (src / "tokenizer.json").write_text('{"tokenizer": "carried"}')
    original = _safetensors(src)
    weights, back = tmp_path / "megatron", tmp_path / "back"
    per_rank = run_distributed(_worker, 4, str(src), str(weights), str(back))
    marker = json.loads((weights / "unirl_megatron.json").read_text())
    assert marker["layout"] == {"tp": 2, "pp": 2, "vpp": 1, "ep": 2, "etp": 1}
    assert marker["dtype"] == "fp32"
    assert not list(weights.glob("*.safetensors"))  # only megatron's shards hold weights
    exported = _safetensors(back)
    assert set(exported) == set(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    assert (back / "tokenizer.json").read_text() == '{"tokenizer": "carried"}'
    config = json.loads((back / "config.json").read_text())
    assert config["num_hidden_layers"] == HF_CONFIG["num_hidden_layers"]
    assert transformers.AutoModelForCausalLM.from_pretrained(str(back)) is not None
    for result in per_rank:
        assert set(result["started"]) == set(original)
        for name, value in original.items():
            assert torch.equal(result["started"][name], value), name
        assert "layout" in result["refusal"] and "--tp 2 --pp 1" in result["refusal"]


def test_convert_refusals(tmp_path):
    """What `convert` refuses before any process group or model is built."""
    from unirl.convert import convert
    from unirl.core.errors import ConfigError

    src = tmp_path / "hf"
    _hf_model().save_pretrained(src)
    with pytest.raises(ConfigError, match=r"SOURCE .*nowhere.* does not exist"):
        convert(str(tmp_path / "nowhere"), str(tmp_path / "o"), dict.fromkeys(LAYOUT), None)
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match=r"OUT .*taken.* exists"):
        convert(str(src), str(tmp_path / "taken"), dict.fromkeys(LAYOUT), None)
    fake = tmp_path / "weights"
    shutil.copytree(src, fake)
    (fake / "unirl_megatron.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--tp apply to a Hugging Face SOURCE only"):
        convert(str(fake), str(tmp_path / "o"), {**dict.fromkeys(LAYOUT), "tp": 2}, None)
    # the Hugging Face engines (DeepSpeed, FSDP2) name the folder and the way back
    from unirl.backends.causal_lm import load_pretrained

    with pytest.raises(ConfigError, match=r"is a Megatron weights folder .*unirl convert"):
        load_pretrained(str(fake), torch.float32)
    with pytest.raises(ConfigError, match=r"needs a number of ranks divisible by tp x pp = 2"):
        convert(str(src), str(tmp_path / "o"), {**dict.fromkeys(LAYOUT), "tp": 2}, None)
    # a tensor missing from the folder: named, before anything is built
    from safetensors.torch import save_file

    (file,) = src.glob("*.safetensors")
    tensors = load_file(str(file))
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert gone in tensors
    del tensors[gone]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=gone.replace(".", r"\.")):
        convert(str(src), str(tmp_path / "o"), dict.fromkeys(LAYOUT), None)
