"""Megatron weights folders: a Hugging Face model converted once into megatron-core's sharded
checkpoint for one parallel layout (``unirl convert HF_DIR OUT --tp 2 ...``), read back as the
initial weights of a Megatron run (``model.path: OUT``) or converted to Hugging Face again.

Why: every rank of a run started from a Hugging Face folder reads the safetensors and slices
its own shards (`convert.load_hf_weights`); a weights folder holds megatron's own shards, written
and read by `megatron.core.dist_checkpointing` (the format of the run's checkpoints, model only:
no optimizer, no RNG, no run state, so it starts a run, it does not resume one).

Layout of ``OUT/``::

    config.json, tokenizer files, ...   every file of the HF folder except its weights, so
                                        model.path's config and tokenizer read as before
    megatron/                           dist_checkpointing.save of {"model0": chunk 0, ...}
    unirl_megatron.json                 the layout (tp, pp, vpp, ep, etp) and the dtype, written
                                        last: a folder without it is not a weights folder

A run loads the folder only in the layout it was written for (the error names both); the weights
are stored in the dtype they were converted in and cast on load to ``model.dtype``, as a Hugging
Face folder's are.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.core.config.run_config import ParallelConfig
from unirl.core.errors import ConfigError

logger = logging.getLogger(__name__)

MARKER = "unirl_megatron.json"
SHARDS = "megatron"
FORMAT = "unirl-megatron-weights/1"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARALLEL_KEYS = ("tp", "pp", "vpp", "ep", "etp")
_WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")


def is_weights_folder(path: str | Path) -> bool:
    return (Path(path).expanduser() / MARKER).is_file()


def layout_of(parallel: ParallelConfig) -> dict[str, int]:
    """What the shards depend on (the data-parallel size does not: weights are replicated)."""
    return {
        "tp": parallel.tp,
        "pp": parallel.pp,
        "vpp": parallel.vpp or 1,
        "ep": parallel.ep,
        "etp": parallel.etp or parallel.tp,
    }


@attrs.frozen
class MegatronWeights:
    """A weights folder as a model's initial weights (`sources.ModelSource.weights`)."""

    folder: Path

    @property
    def marker(self) -> dict[str, Any]:
        return json.loads((self.folder / MARKER).read_text())

    def check_layout(self, parallel: ParallelConfig, key: str = "model.path") -> None:
        saved, ours = self.marker["layout"], layout_of(parallel)
        if saved != ours:
            raise ConfigError(
                f"{key}={str(self.folder)!r} is a Megatron weights folder for the layout "
                f"{saved}, this run has {ours}; set parallel to that layout, or convert the "
                f"model for this one (unirl convert HF_DIR OUT {_flags(ours)})"
            )

    @torch.no_grad()
    def load_into(self, chunks: Sequence[torch.nn.Module], parallel: ParallelConfig) -> None:
        """Every parameter of this rank's chunks from the shards (collective over the world)."""
        from megatron.core import dist_checkpointing

        self.check_layout(parallel)
        sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
        try:
            loaded = dist_checkpointing.load(sharded, str(self.folder / SHARDS))
        except Exception as exc:  # megatron's CheckpointingException names the missing keys
            raise ConfigError(
                f"Megatron weights folder {str(self.folder)!r} does not fit this model: {exc}"
            ) from exc
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"], strict=True)


def _flags(layout: Mapping[str, int]) -> str:
    return " ".join(f"--{k} {v}" for k, v in layout.items())


def _copy_non_weights(src: Path, dst: Path) -> None:
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_FILES):
            shutil.copy2(item, dst / item.name)


def _source_dtype(weights: Any, src: Path) -> torch.dtype:
    """The one dtype of a Hugging Face folder's tensors (a mixed folder must name one)."""
    dtypes = weights.dtypes()
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES.values():
        raise ConfigError(
            f"the tensors of {str(src)!r} are stored as {sorted(map(str, dtypes))}; choose the "
            f"dtype of the Megatron weights with --dtype {' or '.join(DTYPES)}"
        )
    return next(iter(dtypes))


def _check_complete(weights: Any, hf_config: Any, src: Path) -> None:
    """Every tensor the model needs is there and none would be dropped, checked on every rank
    before any collective (a rank's own layers only would fail on some ranks and hang others)."""
    from unirl.backends.megatron.weights.hf_layout import (
        PerExpertView,
        check_nothing_dropped,
        expected_hf_names,
    )

    view = PerExpertView(weights)
    check_nothing_dropped(view, hf_config, str(src))
    missing = [n for n in expected_hf_names(hf_config) if n not in view]
    if missing:
        raise ConfigError(
            f"weights in {str(src)!r} have no {missing[0]!r} ({len(missing)} missing); the "
            f"weights do not match its config.json (model_type={hf_config.model_type!r})"
        )


def hf_to_weights_folder(
    src: str | Path, out: str | Path, parallel: ParallelConfig, *, dtype: str | None
) -> Path:
    """Collective over the launched ranks (world size: a multiple of tp x pp and of
    etp x ep x pp): convert the Hugging Face folder ``src`` into the weights folder ``out``.
    ``dtype`` None keeps the folder's own dtype."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.compat import cpu as cpu_compat
    from unirl.backends.megatron.model import build_model_chunks, check_hf_config
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_io import HFSafetensors, read_hf_config
    from unirl.backends.megatron.weights.hf_layout import load_hf_weights
    from unirl.backends.process_group import destroy_process_group, init_process_group

    src, out = Path(src).expanduser(), Path(out).expanduser()
    hf_config = read_hf_config(src, key="SOURCE")
    weights = HFSafetensors(src)
    torch_dtype = DTYPES[dtype] if dtype is not None else _source_dtype(weights, src)
    check_hf_config(hf_config, parallel)
    _check_complete(weights, hf_config, src)
    setup = init_process_group(parallel)
    try:
        if setup.device.type == "cpu":
            cpu_compat.install()
        initialize_parallel_state(parallel)
        topo = topology_from_parallel_state()
        partial = out.with_name(out.name + ".partial")
        if topo.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / SHARDS).mkdir(parents=True)
            _copy_non_weights(src, partial)
        dist.barrier()
        chunks = build_model_chunks(hf_config, parallel, dtype=torch_dtype)
        load_hf_weights(chunks, weights, hf_config, topo)
        dist_checkpointing.save(
            {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)},
            str(partial / SHARDS),
        )
        dist.barrier()
        if topo.rank == 0:
            name = next(k for k, v in DTYPES.items() if v == torch_dtype)
            marker = {
                "format": FORMAT,
                "layout": layout_of(parallel),
                "parallel": {k: getattr(parallel, k) for k in PARALLEL_KEYS},
                "dtype": name,
            }
            (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.replace(partial, out)
        dist.barrier()
        ps.destroy_model_parallel()
    finally:
        destroy_process_group(setup)
    return out


def weights_folder_to_hf(src: str | Path, out: str | Path) -> Path:
    """Collective over the launched ranks: the weights folder ``src`` as a Hugging Face folder
    ``out`` (weights, config, and the tokenizer and other files it carried over)."""
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron.compat import cpu as cpu_compat
    from unirl.backends.megatron.model import build_model_chunks
    from unirl.backends.megatron.topology import (
        initialize_parallel_state,
        topology_from_parallel_state,
    )
    from unirl.backends.megatron.weights.hf_io import read_hf_config
    from unirl.backends.megatron.weights.hf_layout import save_hf
    from unirl.backends.process_group import destroy_process_group, init_process_group

    src, out = Path(src).expanduser(), Path(out).expanduser()
    source = MegatronWeights(src)
    marker = source.marker
    parallel = ParallelConfig(**marker["parallel"])
    hf_config = read_hf_config(src, key="SOURCE")
    setup = init_process_group(parallel)
    try:
        if setup.device.type == "cpu":
            cpu_compat.install()
        initialize_parallel_state(parallel)
        topo = topology_from_parallel_state()
        chunks = build_model_chunks(hf_config, parallel, dtype=DTYPES[marker["dtype"]])
        source.load_into(chunks, parallel)
        save_hf(out, chunks, hf_config, topo)
        if topo.rank == 0:
            for item in src.iterdir():
                if item.is_file() and item.name not in (MARKER, "config.json"):
                    shutil.copy2(item, out / item.name)
        dist.barrier()
        ps.destroy_model_parallel()
    finally:
        destroy_process_group(setup)
    return out
