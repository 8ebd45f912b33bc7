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
