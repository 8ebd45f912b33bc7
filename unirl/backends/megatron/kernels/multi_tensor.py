"""megatron-core's gradient norm and clipping without TE or Apex in torch's multi-tensor
(``_foreach``) kernels: no host sync per gradient.

Without TE's or Apex's multi-tensor kernels ``optimizer/clip_grads.py`` (megatron-core 0.16.1,
lines 35-43) binds ``l2_norm_impl`` and ``multi_tensor_scale_impl`` to
``megatron.core.utils.local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``. The norm
(utils.py:1205-1206) takes ``torch.norm`` of each gradient and then ``torch.tensor`` of the list
of CUDA scalars, which reads each one back to the host: one kernel and one host sync per
gradient tensor, every optimizer step (2,107 of each on one H200 for the 8-layer Qwen3-30B-A3B
shape, whose 2,048 expert weights are tensors of their own). The scale (utils.py:1214-1215,
only when clipping) runs two kernels per gradient. `foreach_l2_norm` / `foreach_scale` compute
the same values with ``torch._foreach_norm`` / ``torch._foreach_mul_`` (a few kernels for any
number of tensors) and keep the norm on the device; megatron reads the total norm once
(clip_grads.py:133), as with Apex.

`install` binds both where megatron bound its local fallbacks, on CUDA, for `CHECKED_VERSIONS`;
on the CPU `cpu_compat` owns these names (it runs the fallbacks on the host).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The megatron-core versions whose clip_grads.py / utils.py lines above were read.
CHECKED_VERSIONS = ("0.16.1",)

_state: dict[str, bool] = {"installed": False}


def foreach_l2_norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], *args: Any
) -> tuple[torch.Tensor, None]:
    """``amp_C.multi_tensor_l2norm``'s result without per-tensor norms: the l2 norm of every
    tensor of ``tensor_lists[0]`` together, as a one-element fp32 tensor on their device."""
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


def foreach_scale(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]], scale: float
) -> None:
    """``dst = src * scale`` for each pair of ``tensor_lists`` ``[src, dst]`` (in place when
    megatron passes the same list twice, as ``clip_grad_by_total_norm_fp32`` does)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install() -> bool:
    """Bind `foreach_l2_norm` / `foreach_scale` in ``clip_grads`` (idempotent) where megatron
    bound its local fallbacks and CUDA is present; True when they are bound."""
    if _state["installed"]:
        return True
    from megatron.core import package_info, utils
    from megatron.core.optimizer import clip_grads

    if not torch.cuda.is_available():
        return False  # cpu_compat's
    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return False  # TE's or Apex's kernels
    if package_info.__version__ not in CHECKED_VERSIONS:
        logger.info(
            "gradient norm: megatron's per-tensor fallback (megatron-core %s; "
            "unirl/backends/megatron/kernels/multi_tensor.py was read against %s)",
            package_info.__version__,
            ", ".join(CHECKED_VERSIONS),
        )
        return False
    clip_grads.l2_norm_impl = foreach_l2_norm
    clip_grads.multi_tensor_scale_impl = foreach_scale
    _state["installed"] = True
    logger.info("gradient norm and clipping in torch._foreach kernels (no TE / Apex)")
    return True
