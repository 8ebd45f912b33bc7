"""What the verified sync adds to vLLM's workers (``LLM(worker_extension_cls=WORKER_EXTENSION)``,
fingerprint.py); vLLM imports this module in each worker process, never in the trainer's.

On the CPU, vLLM packs every linear layer's weight into a kernel of its own after loading and
empties the parameter (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), so nothing
readable would be left to fingerprint but the kernel itself, whose read-back costs K times the
weight's reading (for a ~100M model, about nine times the sync). Importing this module makes vLLM
keep the parameter beside its packed copy: one more copy of the linear weights in the CPU
engine's memory, the price of a check at the cost of one read. GPU engines compute with the
parameters themselves; nothing changes there.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from unirl.rollouts.vllm.adapter import worker_adapter_fingerprint
from unirl.rollouts.vllm.fingerprint import worker_fingerprint


def _keep_cpu_linear_weights() -> None:
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_unirl_keeps_weight", False):
        return

    @functools.wraps(dispatch)
    def keeping(layer: Any, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keeping._unirl_keeps_weight = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keeping  # linear.py looks it up at each call


_keep_cpu_linear_weights()


class FingerprintWorker:
    """Mixed into vLLM's worker class: ``collective_rpc("unirl_fingerprint")``, and under
    ``model.lora`` ``collective_rpc("unirl_adapter_fingerprint", args=(lora_id,))`` (adapter.py)."""

    def unirl_fingerprint(self) -> dict[str, list[float]]:
        with torch.no_grad():
            return worker_fingerprint(self.model_runner.model)  # type: ignore[attr-defined]

    def unirl_adapter_fingerprint(self, lora_id: int) -> dict[str, list[float]] | None:
        with torch.no_grad():
            return worker_adapter_fingerprint(self.model_runner, lora_id)  # type: ignore[attr-defined]
