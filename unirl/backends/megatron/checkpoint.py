"""Training checkpoints of the Megatron backend: megatron-core's distributed checkpointing for the
model chunks and the optimizer, plus each rank's RNG states, the LR schedule position and core's
client state; written so that a crash never leaves a checkpoint that looks complete.

Layout of ``<path>/`` (a filesystem every rank sees)::

    dist/                  dist_checkpointing.save of {"model0": chunk 0, ..., "optimizer": ...}
                           (under LoRA only the adapter of each chunk: the base is frozen)
                           (each rank writes its own shards; megatron's sharded_state_dict names
                           every tensor by its global position, so TP / PP shards never clash)
    critic/                the critic's chunks and optimizer, the same way (when the run has one)
    unirl.pt               {"client_state", "steps_done", "layout", "extra"} from rank 0
    optimizer_host_rank00000_0.pt  under optimizer.offload: rank 0's offloaded optimizer state,
                           one file per offloaded optimizer (dense, expert: `offload_state`;
                           not in dist/), ...
    rng_rank00000.pt       python / numpy / torch CPU / CUDA generator states of rank 0, ...
    complete               written last, by rank 0, after every rank has finished

Every rank writes into ``<path>.partial``; after a barrier rank 0 writes ``complete`` and renames
the folder (readers see all or nothing). Loading refuses a folder without ``complete`` and one
written under another parallel layout.
"""

from __future__ import annotations

import logging
import queue
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from unirl.backends.megatron.lora.layout import is_adapter_parameter
from unirl.backends.megatron.offload_state import (
    hybrids_of,
    load_host_state,
    reset_host_state,
    save_host_state,
)
from unirl.backends.megatron.optimizer import adam_step, fuse_adam, inner_optimizers
from unirl.core.errors import ConfigError
from unirl.core.run.checkpointing import (
    load_state,
    partial_dir,
    publish,
    read_marker,
    rng_state,
    set_rng_state,
)
from unirl.core.topology import Topology

logger = logging.getLogger(__name__)

DIST = "dist"
META = "unirl.pt"
# The distributed optimizer's format: each rank's own flat buffers (no gather; reshardable over
# data-parallel ranks only). megatron 0.16.1's default, fully_sharded_model_space, saves
# flattened ranges, which its torch_dist format then refuses.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / f"rng_rank{rank:05d}.pt"


def layout_of(topology: Topology) -> dict[str, int | None]:
    return {
        "world_size": topology.world_size,
        "tp": topology.tp_size,
        "pp": topology.pp_size,
        "vpp": topology.vpp_size,
        "cp": topology.cp_size,
        "dp": topology.dp_size,
    }


def has_optimizer_state(optimizer: Any) -> bool:
    """Whether Adam's moments exist yet: torch creates them at the first step, and megatron's
    sharded optimizer state can only be saved and loaded once they do."""
    return any(len(inner.state) > 0 for inner in inner_optimizers(optimizer))


def reset_optimizer_state(optimizer: Any) -> None:
    """Back to a never-stepped optimizer at the current weights: no moments, fp32 main weights
    copied from the model (a checkpoint saved before the first step)."""
    hosts = hybrids_of(optimizer)
    if hosts:  # optimizer.offload: the master copies are the host optimizers'
        reset_host_state(hosts)
        return
    for inner in inner_optimizers(optimizer):
        inner.state.clear()
    optimizer.reload_model_params()


def materialize_optimizer_state(optimizer: Any) -> None:
    """Give a never-stepped optimizer Adam's state (zeros, step 0) so that a checkpoint can be
    loaded into it: megatron 0.16.1's distributed optimizer reads ``step`` from torch's AdamW
    state while building its sharded state dict, and torch creates that state only at the first
    step. The loaded values replace these."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state[param]
                if not state:
                    state["step"] = adam_step(0.0, group, param)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def set_adam_steps(optimizer: Any, steps_done: int) -> None:
    """Give every parameter its own Adam ``step`` tensor, equal to the optimizer steps taken.

    megatron 0.16.1's distributed optimizer without Apex / Transformer Engine restores torch
    AdamW's ``step`` wrongly: measured on the CPU, one below the saved count after a resume, and
    one tensor shared by every parameter (torch increments ``state["step"]`` in place, so a shared
    counter would advance once per parameter per step). Either breaks Adam's bias correction.
    Every applied optimizer step advances every parameter's count once, so the count is the
    number of steps taken since the state was created, which the checkpoint records."""
    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            for param in group["params"]:
                state = inner.state.get(param)
                if state and "step" in state:
                    state["step"] = adam_step(steps_done, group, param)


def _trained_state(chunk_state: dict[str, Any]) -> dict[str, Any]:
    """A chunk's entries that training changes: under LoRA only the adapter's (the frozen base
    comes from ``model.path`` again on resume, so a checkpoint is megabytes, not the model),
    otherwise all of them."""
    adapter = {k: v for k, v in chunk_state.items() if is_adapter_parameter(k)}
    return adapter or chunk_state


def sharded_state(
    ddp_chunks: Sequence[torch.nn.Module], optimizer: Any, *, is_loading: bool, with_optimizer: bool
) -> dict[str, Any]:
    """The sharded state dict of every chunk (``model<i>``) and, once it has state, of the
    optimizer, which maps its state onto the chunks' sharded parameters."""
    state: dict[str, Any] = {
        f"model{i}": _trained_state(ddp.module.sharded_state_dict())
        for i, ddp in enumerate(ddp_chunks)
    }
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    return state


def in_process_write_results() -> None:
    """Let megatron's torch_dist writer hand its write results over in this process.

    megatron-core 0.16.1's `FileSystemWriterAsync` passes each save's write results to the
    caller through one queue per process (``filesystem_async._get_write_results_queue``): a
    ``multiprocessing.Manager`` queue, made for asynchronous saves (a forked process writes, the
    trainer reads). Its first use starts the manager's server process, which imports torch to
    unpickle the results: about 3 s of each process's first save on a CPU test runner. This
    backend saves synchronously (``dist_checkpointing.save`` without ``async_sharded_save``),
    which puts and reads the results in the calling process, so a `queue.Queue` carries them;
    the files written are the same. Does nothing once a queue exists, or in a megatron-core
    without that attribute."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if hasattr(filesystem_async, "_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    writer = getattr(filesystem_async, "FileSystemWriterAsync", None)
    if writer is not None and hasattr(writer, "write_preloaded_data_multiproc"):
        writer.write_preloaded_data_multiproc = staticmethod(_write_in_process)


def _write_in_process(
    transform_list: Any, use_msc: bool, rank: int, write_buckets: Any, results: Any
) -> None:
    """megatron-core 0.16.1's ``write_preloaded_data_multiproc`` without its forked writer
    processes: each write bucket written here, in turn. Forking a process that runs other
    threads (`unirl serve`'s HTTP server and worker) crashed the forked writer (a segfault in
    the child, the save then waiting for it forever); the files written are the same."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    local: queue.Queue = queue.Queue()
    count: queue.Queue = queue.Queue()
    out: dict[int, Any] = {}
    for i, bucket in enumerate(write_buckets):
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True)
        index, written = local.get()
        if isinstance(written, Exception):
            results.put(written)
            return
        out[index] = written
    results.put(out)


@attrs.frozen
class ExtraModel:
    """Another trained model of the run (the critic), saved beside the policy under its name."""

    ddp_chunks: Sequence[torch.nn.Module]
    optimizer: Any
    steps_done: int


def save_checkpoint(
    path: Path,
    ddp_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    topology: Topology,
    *,
    client_state: Mapping[str, Any],
    steps_done: int,
    extra: Mapping[str, ExtraModel] | None = None,
) -> None:
    """Collective: every rank calls it with the same `path`."""
    extra = dict(extra or {})
    from megatron.core import dist_checkpointing

    path = Path(path)
    partial = partial_dir(path)
    if topology.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        (partial / DIST).mkdir(parents=True)
        for name in extra:
            (partial / name).mkdir()
    dist.barrier()
    in_process_write_results()
    with_optimizer = has_optimizer_state(optimizer)
    hosts = hybrids_of(optimizer)  # optimizer.offload: their state saved by rank (offload_state)
    dist_checkpointing.save(
        sharded_state(
            ddp_chunks, optimizer, is_loading=False, with_optimizer=with_optimizer and not hosts
        ),
        str(partial / DIST),
    )
    if hosts and with_optimizer:
        save_host_state(hosts, partial, topology.rank)
    extra_meta = {}
    for name, model in extra.items():
        model_opt = has_optimizer_state(model.optimizer)
        dist_checkpointing.save(
            sharded_state(
                model.ddp_chunks, model.optimizer, is_loading=False, with_optimizer=model_opt
            ),
            str(partial / name),
        )
        extra_meta[name] = {"steps_done": model.steps_done, "optimizer_state": model_opt}
    torch.save(rng_state(), _rng_file(partial, topology.rank))
    if topology.rank == 0:
        meta = {
            "client_state": dict(client_state),
            "steps_done": steps_done,
            "optimizer_state": with_optimizer and not hosts,
            "optimizer_host_state": with_optimizer and bool(hosts),
            "layout": layout_of(topology),
            "extra": extra_meta,
        }
        torch.save(meta, partial / META)
    dist.barrier()
    if topology.rank == 0:
        publish(partial, path, layout_of(topology), client_state=client_state)
    dist.barrier()


def _load_model(
    folder: Path, ddp_chunks: Sequence[torch.nn.Module], optimizer: Any, meta: Mapping[str, Any]
) -> None:
    from megatron.core import dist_checkpointing

    with_optimizer = bool(meta["optimizer_state"])
    if with_optimizer:
        materialize_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(
        sharded_state(ddp_chunks, optimizer, is_loading=True, with_optimizer=with_optimizer),
        str(folder),
    )
    for i, ddp in enumerate(ddp_chunks):
        state = loaded[f"model{i}"]
        # under LoRA the adapter alone (`_trained_state`): the frozen base stays as loaded
        adapter_only = any(is_adapter_parameter(k) for k in state)
        missing, unexpected = ddp.module.load_state_dict(state, strict=not adapter_only)
        left = [k for k in [*missing, *unexpected] if is_adapter_parameter(k) or k in unexpected]
        assert not left, f"checkpoint {folder}: adapter entries {left[:3]} not loaded"
    with torch.no_grad():  # megatron copies into the main parameters in place
        if with_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
            fuse_adam(optimizer)  # the checkpoint's parameter groups replaced the flags
            set_adam_steps(optimizer, int(meta["steps_done"]))
        else:
            reset_optimizer_state(optimizer)


def load_checkpoint(
    path: Path,
    ddp_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    topology: Topology,
    *,
    extra: Mapping[str, ExtraModel] | None = None,
) -> tuple[dict[str, Any], int, dict[str, int]]:
    """Restore the chunks, the optimizer, the ``extra`` models and this rank's RNG states;
    returns the client state, the number of optimizer steps taken before the save (the LR
    schedule position) and each extra model's."""

    path = Path(path)
    saved = read_marker(path)
    ours = layout_of(topology)
    if saved != ours:
        raise ConfigError(
            f"checkpoint {str(path)!r} was written with parallel layout {saved}, this run has "
            f"{ours}; resume with the same parallel settings and number of ranks"
        )
    meta = load_state(path / META)
    hosts = hybrids_of(optimizer)
    if meta["optimizer_state"] and hosts:
        raise ConfigError(
            f"checkpoint {str(path)!r} holds the optimizer's state as kept on the GPU, this run "
            "offloads it; resume with optimizer.offload: none"
        )
    _load_model(path / DIST, ddp_chunks, optimizer, meta)
    if meta.get("optimizer_host_state"):
        if not hosts:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds an offloaded optimizer's state, this run keeps "
                "it on the GPU; resume with optimizer.offload: cpu"
            )
        load_host_state(hosts, path, topology.rank)
    saved_extra = meta.get("extra", {})
    extra_steps = {}
    for name, model in (extra or {}).items():
        if name not in saved_extra:
            raise ConfigError(
                f"checkpoint {str(path)!r} holds no {name} state (it was written by a run "
                f"without a {name}); resume with the config that wrote it, or start a new run"
            )
        _load_model(path / name, model.ddp_chunks, model.optimizer, saved_extra[name])
        extra_steps[name] = int(saved_extra[name]["steps_done"])
    set_rng_state(load_state(_rng_file(path, topology.rank)))
    return dict(meta["client_state"]), int(meta["steps_done"]), extra_steps
