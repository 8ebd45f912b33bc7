"""The verified sync's statistics of GPU tensors in one read: each program walks its share of a
tensor's elements, casts them in registers to the receiver's dtype and then to float64, and adds
its sum, sum of squares and largest |x| into the tensor's key's slot with atomics. One launch
covers many tensors (a bucket, a model's parameters): the slots of every key live in one buffer
per device (`DeviceSums`) and reach the host in one copy.

Why a kernel: the torch path cast every chunk to a float64 copy (four times the bf16 bytes,
written once and read twice) and waited for the GPU once per tensor: 0.16 s per side at
Qwen2.5-7B's shape against a 0.039 s IPC sync on an H100. One kernel per tensor was 0.02 s, most
of it the host's launches (339 tensors); one read of the weights is the floor (about 5 ms for
15 GB at the card's bandwidth). The sums stay float64 per element, so both sides agree to float64
rounding whatever their order (the atomics' order varies from run to run).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_MAX_TENSORS = 65535  # CUDA's limit on a grid's y dimension: tensors per launch
_CASTS = {None: 0, torch.bfloat16: 1, torch.float16: 2}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
Stats = tuple[float, float, float, float]  # as `fingerprint.Stats`


@triton.jit
def _add(x, s, q, m, CAST: tl.constexpr):
    if CAST == 1:
        x = x.to(tl.bfloat16, fp_downcast_rounding="rtne")  # as torch casts
    elif CAST == 2:
        x = x.to(tl.float16, fp_downcast_rounding="rtne")
    xd = x.to(tl.float64)
    # x^2 is exact for values of up to 26 significant bits (bf16, fp16, fp32)
    return s + xd, q + xd * xd, tl.maximum(m, tl.abs(x.to(tl.float32)))


@triton.jit
def _stats_kernel(
    x_ptr,
    offsets_ptr,
    numels_ptr,
    slots_ptr,
    sums_ptr,
    peak_ptr,
    BLOCK: tl.constexpr,
    CAST: tl.constexpr,
    ALIGN: tl.constexpr,
):
    # program (p, t): tensor t's whole blocks p, p + P, ... (unmasked, so the loads vectorise)
    # and, on p = 0, its last partial block; tensor t starts ``offsets[t]`` elements after x_ptr
    t = tl.program_id(1)
    pid = tl.program_id(0).to(tl.int64)
    n = tl.load(numels_ptr + t)
    start = tl.load(offsets_ptr + t)
    slot = tl.load(slots_ptr + t)
    offs = tl.arange(0, BLOCK)
    s = tl.zeros([BLOCK], dtype=tl.float64)
    q = tl.zeros([BLOCK], dtype=tl.float64)
    m = tl.zeros([BLOCK], dtype=tl.float32)
    whole = (n // BLOCK) * BLOCK
    for first in range(pid * BLOCK, whole, tl.num_programs(0).to(tl.int64) * BLOCK):
        pos = start + first + offs
        if ALIGN > 1:
            pos = tl.max_contiguous(tl.multiple_of(pos, ALIGN), BLOCK)
        s, q, m = _add(tl.load(x_ptr + pos), s, q, m, CAST)
    if pid == 0:
        idx = whole + offs
        x = tl.load(x_ptr + start + idx, mask=idx < n, other=0.0)
        s, q, m = _add(x, s, q, m, CAST)
    tl.atomic_add(sums_ptr + 2 * slot, tl.sum(s, axis=0))
    tl.atomic_add(sums_ptr + 2 * slot + 1, tl.sum(q, axis=0))
    tl.atomic_max(peak_ptr + slot, tl.max(m, axis=0))  # |x| >= 0: float order is integer order


def can_accumulate(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether the kernel takes ``tensor`` cast to ``dtype``: a CUDA floating tensor of at most
    32 bits, cast to bf16 / fp16 (from fp32) or not at all (a widening cast changes no value)."""
    if tensor.device.type != "cuda" or tensor.dtype not in _FLOATS:
        return False
    return _cast(tensor.dtype, dtype) is not False


def _cast(have: torch.dtype, want: torch.dtype | None) -> torch.dtype | bool | None:
    """The in-register cast from ``have`` to ``want``: None (no value changes: none asked, or a
    widening one), bf16 / fp16 (from fp32), or False (not one the kernel does)."""
    if want is None or want == have or want in (torch.float32, torch.float64):
        return None
    if have == torch.float32 and want in (torch.bfloat16, torch.float16):
        return want
    return False


@functools.cache
def _programs(device_index: int) -> int:
    return 4 * torch.cuda.get_device_properties(device_index).multi_processor_count


class DeviceSums:
    """Every key's float64 (sum, sum x^2) and float32 max |x| on one GPU, and its element count
    on the host; nothing waits for the GPU before `read`."""

    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        self.device = device
        self.sums = torch.zeros(capacity, 2, dtype=torch.float64, device=device)
        self.peak = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.index: dict[str, int] = {}
        self.counts: list[int] = []

    def _slot(self, key: str) -> int:
        slot = self.index.get(key)
        if slot is None:
            slot = self.index[key] = len(self.counts)
            self.counts.append(0)
            if slot == self.peak.numel():  # grow: the pending sums move along
                self.sums = torch.cat((self.sums, torch.zeros_like(self.sums)))
                self.peak = torch.cat((self.peak, torch.zeros_like(self.peak)))
        return slot

    def add(self, items: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> None:
        """Each (key, tensor) of ``items`` (`can_accumulate` ones, on this device), cast to
        ``dtype``: one launch per tensor dtype."""
        groups: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for key, tensor in items:
            slot = self._slot(key)
            self.counts[slot] += tensor.numel()
            if tensor.numel():
                groups.setdefault(tensor.dtype, []).append((slot, tensor.detach()))
        for have, group in groups.items():
            for first in range(0, len(group), _MAX_TENSORS):  # the grid's second axis
                self._launch(group[first : first + _MAX_TENSORS], have, _cast(have, dtype))

    def _launch(self, group: list[tuple[int, torch.Tensor]], have: torch.dtype, cast) -> None:
        assert cast is not False, (have, cast)
        flats = [t if t.is_contiguous() else t.contiguous() for _, t in group]
        size = flats[0].element_size()
        base = min(flats, key=lambda t: t.data_ptr())
        offsets = [(t.data_ptr() - base.data_ptr()) // size for t in flats]
        numels = [t.numel() for t in flats]
        meta = torch.tensor([offsets, numels, [slot for slot, _ in group]], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        align = 16 // size if all(o % (16 // size) == 0 for o in offsets) else 1
        programs = min(max(numels) // _BLOCK, _programs(self.device.index or 0))
        grid = (max(1, programs), len(flats))
        _stats_kernel[grid](
            base,
            meta[0],
            meta[1],
            meta[2],
            self.sums,
            self.peak,
            BLOCK=_BLOCK,
            CAST=_CASTS[cast],
            ALIGN=align,
            num_warps=8,
        )

    def read(self) -> dict[str, Stats]:
        """Every key's statistics, in one copy to the host."""
        n = len(self.counts)
        both = torch.cat((self.sums[:n], self.peak[:n, None].double()), dim=1).tolist()
        return {key: (float(self.counts[slot]), *both[slot]) for key, slot in self.index.items()}
