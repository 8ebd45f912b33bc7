"""The local paths a config names, checked before any work by `unirl train` and `unirl check`
alike: a job whose model folder, tokenizer folder or prompt dataset is missing fails at once
(at ``check``, before it is queued), with the key and the fix. A rollout file
(``rollout.file``) is not checked here: ``check`` plans a job, often on another machine than
the one holding finished rollouts, and the file source names it when it opens it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from unirl.core.config.run_config import UnirlConfig
from unirl.core.errors import ConfigError

# "Qwen/Qwen2.5-0.5B", "openai/gsm8k": an owner and a name, as the Hugging Face Hub names them
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_hint(value: str, *, dataset: bool = False) -> str:
    """The fix for a path that reads as a Hub id (unirl downloads nothing at run time): how to
    download it first; empty for anything else."""
    if not _HUB_ID.fullmatch(value) or Path(value).expanduser().exists():
        return ""
    folder = f"./{value.split('/')[-1]}"
    kind = " --repo-type dataset" if dataset else ""
    return (
        f". {value!r} looks like a Hugging Face Hub id; unirl reads local folders only: download "
        f"it first (hf download {value}{kind} --local-dir {folder}) and give that folder"
    )


def _check_model_config(key: str, folder: Path) -> None:
    """The folder's ``config.json`` is a JSON object naming its ``model_type``: what every
    backend reads first (an empty or broken file failed deep inside transformers)."""
    file = folder / "config.json"
    if not file.is_file():
        raise ConfigError(
            f"{key}={str(folder)!r} has no config.json; give a Hugging Face model folder "
            "(save_pretrained writes config.json beside the weights)"
        )
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{key}: {file} is not readable JSON ({exc}); restore it from the model's source"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ConfigError(
            f"{key}: {file} names no model_type (a Hugging Face config.json is a JSON object "
            'with one, e.g. "model_type": "qwen2"); restore it from the model\'s source'
        )


def check_local_paths(cfg: UnirlConfig) -> None:
    """`ConfigError` for a model, reference, critic or tokenizer folder or a prompt dataset
    that is not there."""
    m = cfg.model
    for key, value in (
        ("model.path", m.path),
        ("model.ref_path", m.ref_path),
        ("critic.path", cfg.critic.path),
    ):
        if value is not None and not Path(value).expanduser().is_dir():
            raise ConfigError(
                f"{key}={value!r} is not a directory; give a local Hugging Face model folder "
                f"(config.json and weights){hub_hint(value)}"
            )
        if value is not None:
            _check_model_config(key, Path(value).expanduser())
    if m.tokenizer is not None and not Path(m.tokenizer).expanduser().is_dir():
        raise ConfigError(
            f"model.tokenizer={m.tokenizer!r} is not a directory; give a local Hugging Face "
            f"tokenizer folder (tokenizer.json / tokenizer_config.json){hub_hint(m.tokenizer)}"
        )
    for key, prompts in (
        ("rollout.prompts", cfg.rollout.prompts),
        ("eval.prompts", None if cfg.eval is None else cfg.eval.prompts),
    ):
        if prompts is not None and not Path(prompts).exists():
            raise ConfigError(
                f"{key}={prompts!r} does not exist; give a JSONL or Parquet prompt file or a "
                "Hugging Face datasets folder on this machine"
                f"{hub_hint(prompts, dataset=True)}"
            )
