"""`unirl convert SOURCE OUT`: model weights between Hugging Face folders and unirl's formats,
outside a training run. What SOURCE is decides the direction:

- a Hugging Face folder -> a Megatron weights folder for the layout given by ``--tp --pp --vpp
  --ep --etp`` (`unirl.backends.megatron.weights_folder`), the initial weights of a Megatron run
  with that layout (``model.path: OUT``); run it with as many ranks as that layout needs
  (``torchrun --nproc_per_node N``, gloo on the CPU, NCCL on GPUs);
- a Megatron weights folder -> a Hugging Face folder (its layout's ranks);
- a checkpoint of a run (``checkpoints/step_N``, any backend, any layout) -> a Hugging Face
  folder, exactly what the run's own final export writes: the backend is built from the config
  recorded in the checkpoint, the checkpoint loaded and exported the way `unirl.train` does,
  with the run's tokenizer. Run it with the ranks that wrote the checkpoint. A checkpoint of a
  ``model.lora`` run gives the run's adapter (a PEFT folder), or with ``--merged`` the full model
  ``W + scale * B @ A``;
- a Hugging Face folder with ``--merge-adapter ADAPTER`` (a PEFT folder, e.g. a LoRA run's
  ``adapter/``) -> a Hugging Face folder of the base with the adapter merged in (peft's
  ``merge_and_unload``). An adapter is only ever merged on request. A recorded config that
names code to import (a ``package.module:function`` loss, reward, hook...) is refused unless
``--trust-checkpoint-code`` is given: converting a checkpoint from elsewhere must not run its code.

Every tensor is accounted for: a Hugging Face tensor the model has no parameter for, or a
parameter no tensor fills, is an error naming it (`unirl.backends.megatron.weights.hf_layout`).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

LAYOUT_FLAGS = ("tp", "pp", "vpp", "ep", "etp")


def source_kind(source: Path) -> str:
    """``checkpoint``, ``megatron`` (a weights folder) or ``hf``; anything else is refused."""
    from unirl.core.run.checkpointing import COMPLETE_MARKER

    if (source / COMPLETE_MARKER).is_file():
        return "checkpoint"
    if (source / "unirl_megatron.json").is_file():
        return "megatron"
    if (source / "config.json").is_file():
        return "hf"
    what = "does not exist" if not source.exists() else "holds none of them"
    raise ConfigError(
        f"unirl convert: SOURCE {str(source)!r} {what}; give a Hugging Face model folder "
        "(config.json + safetensors), a Megatron weights folder written by unirl convert, or a "
        "complete checkpoint of a run (checkpoints/step_N with its 'complete' marker)"
    )


def _gcd(a: int, b: int) -> int:
    import math

    return math.gcd(a, b)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def convert(
    source: str,
    out: str,
    layout: dict[str, int | None],
    dtype: str | None,
    *,
    trust_code: bool = False,
    adapter: str | None = None,
    merged: bool = False,
) -> Path:
    """See the module docstring. ``layout``: the flags given (None = not given).
    ``trust_code``: a checkpoint's recorded config may name code to import (`code_references`).
    ``adapter``: a PEFT folder to merge into the Hugging Face SOURCE; ``merged``: a LoRA run's
    checkpoint as its merged full model instead of its adapter."""
    src, dst = Path(source).expanduser(), Path(out).expanduser()
    kind = source_kind(src)
    if dst.exists():
        raise ConfigError(
            f"unirl convert: OUT {str(dst)!r} exists; choose a new directory (nothing is "
            "overwritten)"
        )
    if adapter is not None and kind != "hf":
        raise ConfigError(
            f"unirl convert: --merge-adapter merges into a Hugging Face SOURCE (the base model); "
            f"{str(src)!r} is a {kind} folder (for a LoRA run's checkpoint use --merged)"
        )
    if merged and kind != "checkpoint":
        raise ConfigError(
            f"unirl convert: --merged applies to a LoRA run's checkpoint; {str(src)!r} is a {kind} "
            "folder (to merge a PEFT adapter into a Hugging Face folder use --merge-adapter)"
        )
    if adapter is not None:
        if any(v is not None for v in layout.values()):
            raise ConfigError(
                "unirl convert: --merge-adapter writes a Hugging Face folder; "
                "remove the Megatron layout flags"
            )
        return merge_adapter(src, Path(adapter).expanduser(), dst)
    given = {k: v for k, v in layout.items() if v is not None}
    if kind != "hf" and (given or dtype is not None):
        flags = " ".join(f"--{k}" for k in given) + (" --dtype" if dtype is not None else "")
        raise ConfigError(
            f"unirl convert: {flags.strip()} apply to a Hugging Face SOURCE only; {str(src)!r} "
            f"is a {kind} folder converted in its own layout and dtype: remove them"
        )
    if kind == "hf":
        return _hf_to_megatron(src, dst, given, dtype)
    if kind == "megatron":
        from unirl.backends.megatron.weights_folder import weights_folder_to_hf

        return weights_folder_to_hf(src, dst)
    return checkpoint_to_hf(src, dst, trust_code=trust_code, merged=merged)


def merge_adapter(base: Path, adapter: Path, dst: Path) -> Path:
    """``base`` (a Hugging Face folder) with the PEFT ``adapter`` merged in, saved in ``dst`` in
    the base's dtype with its tokenizer files."""
    import shutil

    import peft
    from transformers import AutoModelForCausalLM

    from unirl.backends.hf.export import TOKENIZER_FILES
    from unirl.backends.peft_folder import CONFIG_FILE, WEIGHTS_FILE

    if not (adapter / CONFIG_FILE).is_file() or not (adapter / WEIGHTS_FILE).is_file():
        raise ConfigError(
            f"unirl convert: --merge-adapter {str(adapter)!r} holds no PEFT adapter "
            f"({CONFIG_FILE} and {WEIGHTS_FILE}); give a LoRA run's adapter/ folder"
        )
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype="auto", local_files_only=True)
    wrapped = peft.PeftModel.from_pretrained(model, str(adapter), local_files_only=True)
    merged = wrapped.merge_and_unload()
    merged.save_pretrained(str(dst))
    for name in TOKENIZER_FILES:
        for folder in (adapter, base):  # the run's tokenizer first
            if (folder / name).is_file() and not (dst / name).exists():
                shutil.copy2(folder / name, dst / name)
    logger.info("merged the adapter %s into %s: %s", adapter, base, dst)
    return dst


def _hf_to_megatron(src: Path, dst: Path, given: dict[str, int], dtype: str | None) -> Path:
    from unirl.core.config.run_config import ParallelConfig

    world = _world_size()
    parallel = ParallelConfig(world_size=world, **given)
    attention = parallel.tp * parallel.pp
    experts = (parallel.etp or parallel.tp) * parallel.ep * parallel.pp
    if world % attention or world % experts:
        raise ConfigError(
            f"unirl convert: --tp {parallel.tp} --pp {parallel.pp} --ep {parallel.ep} --etp "
            f"{parallel.etp or parallel.tp} needs a number of ranks divisible by tp x pp = "
            f"{attention} and by etp x ep x pp = {experts}, got {world}; launch it as torchrun "
            f"--nproc_per_node {attention * experts // _gcd(attention, experts)} -m unirl.cli "
            "convert ..."
        )
    try:
        from unirl.backends.megatron.weights_folder import hf_to_weights_folder
    except ImportError as exc:
        raise ConfigError(
            f"unirl convert to a Megatron layout needs megatron-core ({exc}); "
            "pip install 'unirl[megatron,hf]'"
        ) from None
    return hf_to_weights_folder(src, dst, parallel, dtype=dtype)


_CODE_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def code_references(data: Any, key: str = "") -> list[str]:
    """The ``key=value`` of every string in a parsed config that names code to import
    (``package.module:attribute``), with its dotted key."""
    if isinstance(data, dict):
        return [ref for k, v in data.items() for ref in code_references(v, f"{key}{k}.")]
    if isinstance(data, (list, tuple)):
        return [ref for i, v in enumerate(data) for ref in code_references(v, f"{key}{i}.")]
    if isinstance(data, str) and _CODE_REFERENCE.match(data):
        return [f"{key.rstrip('.')}={data!r}"]
    return []


def _check_trusted(path: Path, saved: dict[str, Any], trust_code: bool) -> None:
    named = code_references(saved)
    if named and not trust_code:
        raise ConfigError(
            f"unirl convert: the config recorded in checkpoint {str(path)!r} names code to "
            f"import ({', '.join(named)}); building its backend would run it. If you trust "
            "this checkpoint's origin, add --trust-checkpoint-code"
        )


def checkpoint_to_hf(
    path: Path, out: Path, *, trust_code: bool = False, merged: bool = False
) -> Path:
    """The run's final export of the checkpoint ``path`` (collective over its ranks): under
    ``model.lora`` its adapter, or with ``merged`` the full merged model."""
    import torch.distributed as dist

    from unirl.backends import build_backend
    from unirl.core.config.run_config import config_from_dict, policy_rl_steps
    from unirl.core.run.checkpointing import read_marker, run_info
    from unirl.rollouts.build import save_run_tokenizer

    saved: Any = run_info(path).get("config")
    if not isinstance(saved, dict):
        raise ConfigError(
            f"unirl convert: checkpoint {str(path)!r} records no config (written by an older "
            "unirl); load it with unirl train --resume and export from there"
        )
    _check_trusted(path, saved, trust_code)
    ranks = read_marker(path).get("world_size")
    if ranks != _world_size():
        raise ConfigError(
            f"unirl convert: checkpoint {str(path)!r} was written by {ranks} ranks, this "
            f"conversion runs on {_world_size()}; run it as torchrun --nproc_per_node {ranks} "
            f"-m unirl.cli convert {path} {out}"
        )
    cfg = config_from_dict(saved, world_size=ranks)
    if merged and cfg.model.lora is None:
        raise ConfigError(
            f"unirl convert: --merged: checkpoint {str(path)!r} is of a run without model.lora "
            "(its weights are already full); remove --merged"
        )
    steps = policy_rl_steps(cfg, cfg.train.rl_steps) * cfg.layout.optimizer_steps_per_rollout
    backend = build_backend(cfg, total_optimizer_steps=max(steps, 1), needs_reference=False)
    try:
        backend.load_checkpoint(path)
        if cfg.model.lora is not None and not merged:
            backend.export_adapter(out)
        else:
            backend.export_hf(out)
        if backend.topology.rank == 0:
            save_run_tokenizer(cfg, out)
        if dist.is_initialized():
            dist.barrier()
    finally:
        backend.close()
    return out
