"""ZeRO-3 without a GPU stream sync per module when a parameter's partition is the whole parameter.

When a parameter's partition group has one rank (one GPU; every rank of its own group), DeepSpeed
0.19.8's ``all_gather_coalesced`` gathers nothing: it returns a ``NoGatherHandle`` /
``NoGatherCoalescedHandle`` (``runtime/zero/partition_parameters.py``, lines 61-117 and 904-914)
that points ``param.data`` at ``param.ds_tensor.to(device, non_blocking=True)`` and whose
``wait()`` calls ``current_stream().synchronize()``. ZeRO-3 waits on a handle before every
submodule's forward and again in backward, so each of them drains the GPU's queue and the next
kernels start only after the host has launched them: on one H200 the 1.5B benchmark's ZeRO-3 step
ran at 26-29% MFU against ZeRO-1's 45% (`benchmarks/results/backend_throughput/2026-12-02_h200_6207b65_liger.json`).

The sync is there for a host-to-device copy (parameters offloaded to CPU memory, the reference
with ``model.ref_offload``). When the partition already lives on the device, ``.to`` returns the
partition itself, nothing is copied, and every reader of ``param.data`` runs on the stream that
would have been synchronised, after whatever wrote the partition: the sync orders nothing.
`install` replaces both ``wait`` methods with one that skips the sync exactly then (``param.data``
shares the partition's storage) and otherwise runs DeepSpeed's own ``wait``.

Installed by `unirl.backends.deepspeed.engine` for ZeRO-3 engines, for `CHECKED_VERSIONS` only:
other versions keep DeepSpeed's behaviour (logged).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The DeepSpeed versions whose NoGatherHandle / NoGatherCoalescedHandle were read.
CHECKED_VERSIONS = ("0.19.8",)

_state: dict[str, bool] = {"installed": False}


def shares_partition(param: Any) -> bool:
    """Whether ``param.data`` is the partition itself (same device and storage): nothing was
    copied to make it available."""
    data, part = param.data, getattr(param, "ds_tensor", None)
    if not isinstance(part, torch.Tensor) or data.device != part.device:
        return False
    return data.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()


def _skipping_wait(
    original: Callable[..., None],
    params_of: Callable[[Any], Sequence[Any]],
    owner: str,
    *,
    check_inflight: bool,
) -> Callable[..., None]:
    """``owner``'s ``wait`` without the sync when nothing was copied; ``check_inflight``: raise
    as DeepSpeed's coalesced handle does on a parameter that is not in flight."""
    complete = f"_{owner}__complete"

    @functools.wraps(original)
    def wait(self: Any, **kwargs: Any) -> None:
        if getattr(self, complete):
            return
        params = params_of(self)
        if not all(shares_partition(p) for p in params):
            return original(self, **kwargs)  # a copy to the device: DeepSpeed's sync
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        for p in params:
            if check_inflight and p.ds_status != ZeroParamStatus.INFLIGHT:
                raise RuntimeError(f"expected param {p.ds_summary()} to be inflight")
            p.ds_status = ZeroParamStatus.AVAILABLE
        setattr(self, complete, True)

    return wait


def install() -> bool:
    """Patch DeepSpeed's two no-gather handles (idempotent); False when left alone."""
    if _state["installed"]:
        return True
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters as pp

    if deepspeed.__version__ not in CHECKED_VERSIONS:
        logger.info(
            "DeepSpeed %s: ZeRO-3's no-gather handles keep their stream sync (unirl read %s)",
            deepspeed.__version__,
            ", ".join(CHECKED_VERSIONS),
        )
        return False
    pp.NoGatherHandle.wait = _skipping_wait(
        pp.NoGatherHandle.wait,
        lambda h: [h._NoGatherHandle__param],
        "NoGatherHandle",
        check_inflight=False,
    )
    pp.NoGatherCoalescedHandle.wait = _skipping_wait(
        pp.NoGatherCoalescedHandle.wait,
        lambda h: list(h._NoGatherCoalescedHandle__params),
        "NoGatherCoalescedHandle",
        check_inflight=True,
    )
    _state["installed"] = True
    return True
