"""Reading and writing Hugging Face model folders (safetensors + config.json), locally only.

`HFSafetensors` is a lazy read-only mapping over a folder's ``model.safetensors`` or sharded
``model.safetensors.index.json``: a pipeline stage reads only the tensors of its own layers.
`write_hf_folder` writes what ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from unirl.core.errors import ConfigError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_map(folder: Path) -> dict[str, Path]:
    if (folder / INDEX_FILE).is_file():
        index = json.loads((folder / INDEX_FILE).read_text())
        return {name: folder / file for name, file in index["weight_map"].items()}
    if (folder / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE_FILE), framework="pt") as f:
            return dict.fromkeys(f.keys(), folder / SINGLE_FILE)
    raise ConfigError(
        f"model.path={str(folder)!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; the Megatron "
        "backend reads safetensors only (re-save the model with save_pretrained(..., "
        "safe_serialization=True))"
    )


class HFSafetensors(Mapping[str, torch.Tensor]):
    """Tensors of a local HF folder by name, read from disk on access (to the CPU)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        self._files = _weight_map(self.folder)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes the tensors are stored in (read from the headers, no tensor is loaded)."""
        from safetensors import safe_open

        out = set()
        for file in set(self._files.values()):
            with safe_open(str(file), framework="pt") as f:
                out |= {f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
        names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
        return {names.get(d, d) for d in out}  # type: ignore[misc]


def read_hf_config(folder: str | Path, *, key: str = "model.path") -> Any:
    """The `transformers` config of a local folder (nothing is downloaded)."""
    from transformers import AutoConfig

    path = Path(folder).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{key}={str(folder)!r} has no config.json; set {key} to a local Hugging Face model "
            "folder (the output of save_pretrained)"
        )
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def write_hf_folder(
    folder: str | Path,
    state_dict: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    max_shard_size: str = "5GB",
) -> None:
    """safetensors (sharded above ``max_shard_size``, with an index) and config.json.

    The config gets ``architectures`` (vLLM and SGLang pick the model class from it) and the
    weights' dtype.
    """
    from huggingface_hub import save_torch_state_dict
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    save_torch_state_dict(dict(state_dict), path, max_shard_size=max_shard_size)
    config = copy.deepcopy(hf_config)
    if not getattr(config, "architectures", None):
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    config.dtype = next(iter(state_dict.values())).dtype
    config.save_pretrained(str(path))
