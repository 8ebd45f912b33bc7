"""The engine's side of the verified sync (`unirl.core.weights.fingerprint`): each vLLM worker
fingerprints the parameters it has loaded, its own tensor-parallel shard of them.

`worker.FingerprintWorker` is mixed into vLLM's workers (``LLM(worker_extension_cls=...)``), so
the leader asks every worker with ``llm.collective_rpc("unirl_fingerprint", ...)`` and merges the
shards' answers (`engine_fingerprint`). Plain data crosses vLLM's channel: key -> four floats.

What a worker counts, so that the merged fingerprint is that of the Hugging Face tensors:
- a sharded parameter (column / row parallel weights, a column-parallel bias, the vocabulary
  shards) on every rank; a replicated one (norms, a row-parallel bias) on tensor rank 0 only;
  fused q/k/v whose k/v heads are replicated over ranks (more ranks than k/v heads): the k/v rows
  only on the first rank of each replica group;
- of an embedding or output head, only the rows of real tokens (vLLM pads the vocabulary);
- a CPU linear's weight as the parameter vLLM packed its kernel from (worker.py keeps it: vLLM
  on the CPU empties it after packing); should it be empty anyway, the weight the kernel
  multiplies with, read back through the kernel (input the identity, in blocks: exact, but
  K times the reading's work).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from unirl.core.weights.fingerprint import (
    Fingerprint,
    compare,
    fingerprinted,
    layer_key,
)
from unirl.core.weights.stream import Bucket, drain

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

_PROBE_ROWS = 512  # identity rows per call when reading a packed CPU weight back


def _packed_weight_rows(module: Any) -> torch.Tensor:
    """The ``[out, in]`` weight of a CPU linear whose parameter vLLM emptied into a packed
    kernel: ``cpu_linear(I)`` is ``W^T``, exact (each output is one weight times 1)."""
    k = int(module.input_size_per_partition)
    dtype = module.weight.dtype
    parts = []
    for start in range(0, k, _PROBE_ROWS):
        rows = min(_PROBE_ROWS, k - start)
        eye = torch.zeros(rows, k, dtype=dtype)
        eye[:, start : start + rows] = torch.eye(rows, dtype=dtype)
        parts.append(module.cpu_linear(eye, module.weight, None))
    return torch.cat(parts).t()


def _tp() -> tuple[int, int]:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def _qkv_parts(module: Any, t: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """The rows of a fused q/k/v shard this rank counts: q always, k and v once per replica
    group of the k/v heads."""
    replicas = int(getattr(module, "num_kv_head_replicas", 1))
    if replicas <= 1 or rank % replicas == 0:
        return [t]
    return [t[: int(module.num_heads) * int(module.head_size)]]


def module_parts(name: str, param: torch.Tensor, module: Any) -> list[torch.Tensor]:
    """What this worker counts of ``param`` (module docstring); none: another rank counts it."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    rank, size = _tp()
    leaf = name.rsplit(".", 1)[-1]
    sharded = isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)) or (
        isinstance(module, RowParallelLinear) and leaf == "weight"
    )
    if size > 1 and not sharded and rank != 0:
        return []
    t = param.detach()
    if leaf == "weight" and t.numel() == 0 and hasattr(module, "cpu_linear"):
        t = _packed_weight_rows(module)
    if isinstance(module, VocabParallelEmbedding):
        idx = module.shard_indices
        t = t[: idx.org_vocab_end_index - idx.org_vocab_start_index]
    return _qkv_parts(module, t, rank) if isinstance(module, QKVParallelLinear) else [t]


def worker_fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """This worker's shard of the engine's fingerprint, as plain data."""
    out = Fingerprint()
    parts = []
    for name, param in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        parts += [(layer_key(name), part) for part in module_parts(name, param, module)]
    out.add_many(parts)  # on a GPU: one launch for the whole model
    return {k: list(v) for k, v in out.keys.items()}


# The worker extension vLLM mixes into its workers (worker.py; named, not imported: the trainer's
# process never loads it).
WORKER_EXTENSION = "unirl.rollouts.vllm.worker.FingerprintWorker"


def engine_fingerprint(llm: Any) -> Fingerprint:
    """The fingerprint of the weights ``llm`` (a `vllm.LLM`) holds, its workers' shards merged."""
    parts: Sequence[dict[str, list[float]]] = llm.collective_rpc("unirl_fingerprint")
    return Fingerprint.of(parts)  # type: ignore[arg-type]


def verified_sync(
    sync: Callable[[Iterator[Bucket]], None],
    llm_of: Callable[[], Any],
    buckets: Iterator[Bucket],
    *,
    dtype: str,
    receiver: str,
    version: int,
    surviving: Callable[[Callable[[], Fingerprint]], Fingerprint] | None = None,
) -> float:
    """``sync(buckets)`` with the trainer's fingerprint taken as the buckets pass, then the
    engine's (``llm_of()``, the `vllm.LLM` the sync started or updated) compared with it
    (`unirl.core.weights.fingerprint.compare` raises on a difference). A transport that did not
    take every bucket leaves the rest to be fingerprinted here, so a skipped bucket shows as a
    layer that did not land. ``surviving`` runs the engine's fingerprint (the source's restart
    on an engine that dies meanwhile: the restarted engine is fingerprinted instead). Returns
    the verification's seconds (both fingerprints)."""
    sent = Fingerprint(dtype=_TORCH_DTYPES[dtype])
    stream = fingerprinted(buckets, sent)
    sync(stream)
    drain(stream)
    t0 = time.perf_counter()
    held = (surviving or (lambda f: f()))(lambda: engine_fingerprint(llm_of()))
    compare(sent, held, receiver=receiver, version=version)
    return sent.seconds + time.perf_counter() - t0
