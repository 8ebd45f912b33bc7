"""Adapter-only sync to a vLLM engine (``model.lora``; `unirl.core.weights.adapter`).

The engine runs with ``enable_lora`` and keeps the base weights it loaded at the start; each
policy version's adapter is written as a PEFT folder (`unirl.backends.peft_folder`) and loaded as
a new LoRA request, ``LoRARequest(name=f"policy-v{version}", lora_int_id=version + 1, ...)``,
which every generation of that version carries; the superseded request is removed from the engine
and its folder deleted.

Why a folder per version and not in memory: vLLM 0.32's `LoRARequest` names an adapter by its
path only, and its workers load every adapter through ``LoRAModel.from_local_checkpoint`` (also
when a request is first seen after an engine restart); a tensor argument would have to be pickled
through vLLM's message queue to a private loader of ours. The folder lives beside the base
weights (``rollout.vllm.sync_dir``, tmpfs by default: memory, no disk), and an adapter is a few
MB, so writing it costs a memcpy.

What the engine proves after each adapter sync (``rollout.verify_sync``): the adapter in the LoRA
slot its generations use is the one the trainer sent, and its base weights are the ones it
started with. Each worker counts its slot of every LoRA layer's stacked buffers (``lora_a_stacked``
``[max_loras, 1, max_lora_rank, in]``, ``lora_b_stacked`` ``[max_loras, 1, out, max_lora_rank]``,
one per fused slice: q/k/v, gate/up), only the adapter's own rank of the padded ``max_lora_rank``
and only the slices the adapter has (the loaded `LoRAModel` says which); vLLM folded the scale
into B when it loaded it, as the fingerprint's convention counts it. Under tensor parallelism a
sharded factor counts on every rank (B of a column-parallel layer, A of a row-parallel one, both
with ``fully_sharded_loras``), a replicated one on rank 0 only (not run on the CPU machines).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from unirl.backends.peft_folder import write_peft_folder
from unirl.core.config.sections.lora import LoraConfig
from unirl.core.errors import ConfigError
from unirl.core.weights.adapter import adapter_fingerprint
from unirl.core.weights.fingerprint import (
    Fingerprint,
    SyncVerificationError,
    compare,
    layer_key,
)
from unirl.rollouts.vllm.plugin import MAX_LORA_RANKS

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_engine_kwargs(lora: LoraConfig) -> dict[str, Any]:
    """The `vllm.LLM` arguments of an engine serving ``lora``'s adapters: two slots, so that the
    next version's adapter is loaded beside the one in use before that one is removed."""
    fits = [r for r in MAX_LORA_RANKS if r >= lora.rank]
    if not fits:
        raise ConfigError(
            f"model.lora.rank={lora.rank}: vLLM serves adapters of rank at most {MAX_LORA_RANKS[-1]}; "
            "lower model.lora.rank"
        )
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2}


def lora_request(version: int, path: Path) -> Any:
    """The request of policy version ``version``'s adapter (ids from 1: vLLM's 0 is no LoRA)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"policy-v{version}", lora_int_id=version + 1, lora_path=str(path))


class AdapterFolders:
    """PEFT folders ``adapter-v{version}`` under the engine's weight folder, one per version
    still in use."""

    def __init__(self, root: Path, lora: LoraConfig) -> None:
        self.root, self.lora = root, lora

    def path(self, version: int) -> Path:
        return self.root / f"adapter-v{version}"

    def write(self, adapter: Mapping[str, torch.Tensor], version: int) -> Path:
        write_peft_folder(adapter, self.lora, self.path(version))
        return self.path(version)

    def remove(self, version: int) -> None:
        shutil.rmtree(self.path(version), ignore_errors=True)


# -- the worker's side (worker.py calls it in each vLLM worker) -----------------------------------


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _counted_factors(module: Any) -> tuple[bool, bool]:
    """(A counts here, B counts here): a factor sharded over tensor ranks counts on each, a
    replicated one on rank 0 only (module docstring)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    if _tp_rank() == 0:
        return True, True
    full = bool(module.lora_config.fully_sharded_loras)
    column = isinstance(module.base_layer, ColumnParallelLinear)
    row = isinstance(module.base_layer, RowParallelLinear)
    return row or (column and full), column or (row and full)


def _slot_stats(module: Any, slot: int, weights: Any, key: str, out: Fingerprint) -> None:
    """Add what ``module``'s LoRA slot ``slot`` holds of the adapter ``weights`` (vLLM's
    LoRALayerWeights, packed or not) to ``out``."""
    if isinstance(getattr(module, "lora_a_stacked", None), torch.Tensor) and hasattr(
        module, "sharded_to_full_mapping"
    ):  # the LM head (LogitsProcessorWithLoRA): one slice, A [rank, hidden], B [vocab, rank];
        # no decoder layer, so each factor counts under its PEFT name, as the trainer keys it
        if _tp_rank() == 0:  # its factors are whole on every rank
            a, b = weights.lora_a, weights.lora_b
            peft = f"base_model.model.{weights.module_name}"
            a_held = module.lora_a_stacked[slot, 0, : a.shape[0], : a.shape[1]]
            out.add_tensor(layer_key(f"{peft}.lora_A.weight"), a_held)
            b_held = module.lora_b_stacked[slot, 0, : b.shape[0], : b.shape[1]]
            out.add_tensor(layer_key(f"{peft}.lora_B.weight"), b_held)
        return
    if not isinstance(getattr(module, "lora_a_stacked", None), tuple):
        raise RuntimeError(
            f"unirl's adapter check covers linear LoRA layers only; the adapter has weights for "
            f"{key} ({type(module).__name__}): leave it out of model.lora or set "
            "rollout.verify_sync: false"
        )
    loaded = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
    a_here, b_here = _counted_factors(module)
    for index, a in enumerate(loaded):
        if a is None:  # a fused slice the adapter does not target
            continue
        rank = int(a.shape[0])
        if a_here:
            out.add_tensor(key, module.lora_a_stacked[index][slot, 0, :rank])
        if b_here:
            out.add_tensor(key, module.lora_b_stacked[index][slot, 0, :, :rank])


def worker_adapter_fingerprint(model_runner: Any, lora_id: int) -> dict[str, list[float]] | None:
    """This worker's shard of the fingerprint of adapter ``lora_id`` as its LoRA slot holds it,
    as plain data; None when no slot holds it."""
    manager = model_runner.lora_manager._adapter_manager
    if lora_id not in manager.lora_index_to_id:
        return None
    slot = manager.lora_index_to_id.index(lora_id)
    lora_model = manager.get_adapter(lora_id)
    out = Fingerprint()
    for name, module in manager.modules.items():
        weights = manager._get_lora_layer_weights(lora_model, name)
        if weights:
            _slot_stats(module, slot, weights, layer_key(name + ".lora"), out)
    return {k: list(v) for k, v in out.keys.items()}


# -- the leader's side -----------------------------------------------------------------------------


def verify_adapter(
    llm: Any,
    adapter: Mapping[str, torch.Tensor],
    *,
    lora: LoraConfig,
    lora_id: int,
    dtype: str,
    base: Fingerprint,
    receiver: str,
    version: int,
) -> float:
    """Compare the adapter the engine serves (its LoRA request ``lora_id``) with ``adapter``
    (the trainer's), and its base weights with ``base`` (their fingerprint at the start); raise
    `SyncVerificationError` on a difference. Returns the check's seconds."""
    t0 = time.perf_counter()
    sent = adapter_fingerprint(adapter, scale=lora.scale, dtype=_TORCH_DTYPES[dtype])
    check_served_adapter(llm, sent, lora_id=lora_id, base=base, receiver=receiver, version=version)
    return time.perf_counter() - t0


def check_served_adapter(
    llm: Any, sent: Fingerprint, *, lora_id: int, base: Fingerprint, receiver: str, version: int
) -> None:
    """Compare the adapter in the LoRA slot of request ``lora_id`` with ``sent`` (the trainer's
    fingerprint of it, `adapter_fingerprint`) and the engine's base weights with ``base``;
    raise `SyncVerificationError` on a difference (also where no slot holds the adapter)."""
    from unirl.rollouts.vllm.fingerprint import engine_fingerprint

    parts = llm.collective_rpc("unirl_adapter_fingerprint", args=(lora_id,))
    if any(part is None for part in parts):
        raise SyncVerificationError(
            f"the adapter sync of policy version {version} to {receiver} did not land: no LoRA "
            f"slot of the engine holds its adapter (LoRA id {lora_id}); check the engine's log "
            "(logging.level: DEBUG). The newest complete checkpoint is intact: run again with "
            "--resume",
            "adapter",
        )
    held = Fingerprint.of(parts)  # type: ignore[arg-type]
    compare(sent, held, receiver=receiver, version=version, what="adapter sync")
    compare(base, engine_fingerprint(llm), receiver=receiver, version=version, what="base weights")
