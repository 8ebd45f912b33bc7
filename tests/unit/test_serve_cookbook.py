"""tinker-cookbook's supervised and RL loops (``recipes/sl_loop.py``, ``recipes/rl_loop.py``,
pinned 0.6.1), unmodified, a few steps against `unirl serve`: only their tokenizer and datasets
come from local files (`tests.cookbook_fixtures`; the RL loop trains with its default loss,
``stable_reinforce``, on sequences sampled with ``record_stability_info``). The supervised loop's first mean NLL is the base model's (the
adapter's B starts at zero), written out with plain transformers on the rows the loop takes;
FSDP2 and Megatron log DeepSpeed's NLL at every step, and its rewards and gradient norms in the
RL loop (``serve.sample_seed``: the loop sends no seeds; both loops train the LM head too, the
SDK's default ``train_unembed=True``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("peft")
sl_loop = pytest.importorskip("tinker_cookbook.recipes.sl_loop")
rl_loop = pytest.importorskip("tinker_cookbook.recipes.rl_loop")

from tests.cookbook_fixtures import (  # noqa: E402
    MODEL_NAME,
    NO_ROBOTS,
    offline_cookbook,
    teach_answer,
    write_model_and_tokenizer,
)
from tests.serve_fixtures import API_KEY, running_server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS, BATCH = 2, 2


@pytest.fixture(scope="module")
def cookbook_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_and_tokenizer(tmp_path_factory.mktemp("cookbook-model"))


def _sl_loop(folder: Path, tmp_path: Path, train: dict, monkeypatch) -> list[float]:
    """The loop's logged ``train_mean_nll`` per step, on a server with ``train``."""
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    base_models = {MODEL_NAME: str(folder)}
    train = {**train, "progress": {"enabled": False}}
    with running_server(folder, tmp_path / "state", base_models=base_models, train=train) as (
        url,
        _,
    ):
        config = sl_loop.Config(
            base_url=url,
            log_path=str(tmp_path / "log"),
            model_name=MODEL_NAME,
            batch_size=BATCH,
            learning_rate=1e-2,
            max_length=256,
            lora_rank=2,
            save_every=0,
            max_steps=STEPS,
        )
        with offline_cookbook(folder):
            sl_loop.main(config)
    lines = (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train_mean_nll"] for line in lines]


def _first_step_reference(folder: Path) -> float:
    """-sum(w logp) / sum(w) of the base model on the loop's first batch (its rows: the dataset
    shuffled with seed 0), the datums built by the cookbook as the loop builds them."""
    import datasets
    import transformers
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum

    rows = datasets.Dataset.from_list([{"messages": m} for m in NO_ROBOTS]).shuffle(seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    renderer = renderers.get_renderer("qwen3", tokenizer)
    train_on = renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    nll = weight = 0.0
    for row in rows.select(range(BATCH)):
        datum = conversation_to_datum(row["messages"], renderer, 256, train_on)
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = datum.loss_fn_inputs["target_tokens"].to_torch()
        w = datum.loss_fn_inputs["weights"].to_torch().float()
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        nll -= float((logp.gather(-1, targets[:, None])[:, 0] * w).sum())
        weight += float(w.sum())
    return nll / weight


def test_sl_loop_on_deepspeed(cookbook_model, tmp_path, monkeypatch):
    got = _sl_loop(cookbook_model, tmp_path, {"backend": "deepspeed"}, monkeypatch)
    assert len(got) == STEPS
    assert got[0] == pytest.approx(_first_step_reference(cookbook_model), rel=1e-5)
    assert got[1] < got[0]  # the step at lr 1e-2 lowered it


OTHERS = [{"backend": "fsdp2"}, {"backend": "megatron", "model": {"dtype": "fp32"}}]


@pytest.mark.slow  # the same loop again on another backend (a few seconds each)
@pytest.mark.parametrize("other", OTHERS, ids=["fsdp2", "megatron"])
def test_sl_loop_same_as_deepspeed(cookbook_model, tmp_path, monkeypatch, other):
    ds = _sl_loop(cookbook_model, tmp_path / "ds", {"backend": "deepspeed"}, monkeypatch)
    got = _sl_loop(cookbook_model, tmp_path / "other", other, monkeypatch)
    assert got == pytest.approx(ds, rel=1e-5)


@pytest.fixture(scope="module")
def answering_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_model_and_tokenizer(tmp_path_factory.mktemp("cookbook-rl-model"))
    teach_answer(folder, steps=25)
    return folder


def _rl_loop(folder: Path, tmp_path: Path, train: dict, monkeypatch) -> list[dict]:
    """The loop's logged metrics per step."""
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    over = {"base_models": {MODEL_NAME: str(folder)}, "sample_seed": 7}
    train = {**train, "progress": {"enabled": False}}
    with running_server(folder, tmp_path / "state", train=train, **over) as (url, _):
        config = rl_loop.Config(
            base_url=url,
            log_path=str(tmp_path / "log"),
            model_name=MODEL_NAME,
            batch_size=1,  # 3 rows: 3 batches, of which 2 run
            group_size=4,
            learning_rate=1e-2,
            lora_rank=2,
            save_every=0,
            max_tokens=12,
            max_steps=2,  # the loop's default loss: stable_reinforce, with provenance
        )
        with offline_cookbook(folder):
            rl_loop.main(config)
    lines = (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow  # the RL loop on two backends (sampling, saving sampler weights, two steps)
@pytest.mark.parametrize("other", OTHERS, ids=["fsdp2", "megatron"])
def test_rl_loop_same_as_deepspeed(answering_model, tmp_path, monkeypatch, other):
    ds = _rl_loop(answering_model, tmp_path / "ds", {"backend": "deepspeed"}, monkeypatch)
    got = _rl_loop(answering_model, tmp_path / "other", other, monkeypatch)
    assert len(ds) == 2
    assert all(0 < m["reward/total"] < 1 for m in ds)  # mixed rewards: the loop trained
    assert all("grad_norm:mean" in m for m in ds)
    for a, b in zip(ds, got, strict=True):
        assert b["reward/total"] == a["reward/total"]
        assert b["grad_norm:mean"] == pytest.approx(a["grad_norm:mean"], rel=1e-4)
