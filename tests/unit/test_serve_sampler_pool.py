"""The built-in sampler's pool knows saved weights by their save, not their folder's file: weights
saved again under one name (written in place here, the config file's inode unchanged) give a new
sampler with the new weights; the base model's folder is loaded once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf_reference import save_tiny_model  # noqa: E402
from unirl.serve.sampling import SamplerPool  # noqa: E402


def _save(folder: Path, seed: int, save_id: str) -> torch.Tensor:
    """Seed ``seed``'s tiny weights into ``folder/hf``, written over what is there (the folder
    and its config.json stay the same files), with the save's meta.json."""
    source = save_tiny_model(folder / f"seed{seed}", seed=seed)
    hf = folder / "hf"
    hf.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" or not (hf / f.name).exists():
            shutil.copyfile(f, hf / f.name)
    (folder / "meta.json").write_text(json.dumps({"base_model": "tiny", "save_id": save_id}))
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    return model.lm_head.weight.detach().clone()


def test_weights_saved_again_under_one_name_are_loaded_again(tmp_path):
    pool = SamplerPool()
    first = _save(tmp_path / "save", 1, "a")
    inode = (tmp_path / "save" / "hf" / "config.json").stat().st_ino
    got = pool.sampler(tmp_path / "save" / "hf", saved=True)
    torch.testing.assert_close(got.model.lm_head.weight, first, rtol=0, atol=0)
    assert pool.sampler(tmp_path / "save" / "hf", saved=True) is got  # the same save: kept
    second = _save(tmp_path / "save", 2, "b")
    assert (tmp_path / "save" / "hf" / "config.json").stat().st_ino == inode
    assert not torch.equal(first, second)
    again = pool.sampler(tmp_path / "save" / "hf", saved=True)
    torch.testing.assert_close(again.model.lm_head.weight, second, rtol=0, atol=0)


def test_a_base_model_folder_is_loaded_once(tmp_path):
    pool = SamplerPool()
    folder = save_tiny_model(tmp_path / "base")
    assert pool.sampler(folder, saved=False) is pool.sampler(folder, saved=False)


def test_prompt_logprobs_in_chunks_equal_one_forward(tmp_path, monkeypatch):
    """A long prompt's log-probs come from the head in chunks (never all its logits at once):
    the same as log_softmax over one whole forward's logits, written out here."""
    from unirl.serve import sampling

    folder = save_tiny_model(tmp_path / "base")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tuple(int(t) for t in torch.randint(0, model.config.vocab_size, (11,)))
    monkeypatch.setattr(sampling, "PROMPT_CHUNK", 3)
    got = sampling._prompt_logprobs(model, prompt)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert got.shape == (11,) and torch.isnan(torch.tensor(got[0]))
    torch.testing.assert_close(torch.tensor(got[1:]), want, rtol=1e-5, atol=1e-5)


def test_on_a_gpu_one_sampler_is_kept_and_the_old_one_goes_first(tmp_path, monkeypatch):
    """On a GPU the samplers share the card with training: the pool keeps one and drops it
    before the next one loads (no moment with two on the card)."""
    pool = SamplerPool()
    monkeypatch.setattr(pool, "_placement", lambda: (None, torch.float32, 1))
    seen = []
    load = transformers.AutoModelForCausalLM.from_pretrained

    def counting(*args, **kwargs):
        seen.append(len(pool._samplers))
        return load(*args, **kwargs)

    for name, seed in (("a", 1), ("b", 2)):
        _save(tmp_path / name, seed, name)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counting)
    for name in ("a", "b"):
        pool.sampler(tmp_path / name / "hf", saved=True)
    assert seen == [0, 0] and len(pool._samplers) == 1


def _reference_prompt_logprobs(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_prompt_logprobs_of_a_family_that_scales_its_logits():
    """Granite divides its logits by ``logits_scaling`` after the head: its prompt log-probs
    come from the whole forward, as the model computes them (the chunked head would not)."""
    from unirl.serve import sampling

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "granite", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, logits_scaling=8.0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = (3, 9, 27, 17, 51, 26)
    got = sampling._prompt_logprobs(model, prompt)
    want = _reference_prompt_logprobs(model, prompt)
    torch.testing.assert_close(torch.tensor(got[1:]), want, rtol=1e-5, atol=1e-5)


def test_prompt_logprobs_of_a_one_token_prompt(tmp_path):
    """One token has no context: its one entry is NaN (the SDK's None), not an error."""
    from unirl.serve import sampling

    model = transformers.AutoModelForCausalLM.from_pretrained(
        save_tiny_model(tmp_path / "base"), dtype=torch.float32
    )
    got = sampling._prompt_logprobs(model, (5,))
    assert got.shape == (1,) and torch.isnan(torch.tensor(got[0]))
