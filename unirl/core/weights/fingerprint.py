"""Verified weight sync: after a sync, the receiver proves it holds what the trainer sent.

Both sides reduce the weights to one fingerprint per layer: the trainer from the stream's buckets
as they pass (`fingerprinted`, each tensor cast to the receiver's dtype first: what the receiver
can hold), the receiver from its own loaded parameters (vLLM's workers, the sampler's model).
`compare` then stops the run (`SyncVerificationError`) on the first layer that differs.

    seen = Fingerprint(dtype=torch.bfloat16)
    receiver.load(fingerprinted(buckets, seen))
    compare(seen, receiver_fingerprint, receiver="vLLM engine 0", version=3)

A layer's key: ``model.layers.{i}.*`` is ``layer i``; any other parameter is its own key, its
module's name without the ``model.`` prefix (``embed_tokens``, ``norm``, ``lm_head``). Per key,
in float64: the element count, the sum of x, the sum of x^2 and the largest |x|. Each is a sum (or
a max) over the key's elements, so it does not change when a receiver fuses tensors (vLLM's
q/k/v and gate/up), splits them over tensor-parallel shards (the shards' statistics add up;
replicated parameters are counted on one shard only) or stores them in another layout; a receiver
counts only the real vocabulary rows of a padded embedding. The two sides sum in different orders,
so they agree to float64 rounding, not bit for bit (`_close`).

What it cannot catch: a change that keeps every statistic of a layer, e.g. elements permuted
inside a layer (rows swapped, a transposed square matrix, q and k exchanged), or two tensors of
one layer exchanged. It does catch a tensor missing or left at its old or dummy values, a bucket
dropped, truncated or corrupted, a whole sync skipped (once the weights changed), a name that
only one side knows, and a dtype cast the receiver did not do.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from unirl.core.errors import RunError

# (count, sum x, sum x^2, max |x|) per key
Stats = tuple[float, float, float, float]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_CHUNK = 1 << 20  # elements cast to float64 at a time: 8 MiB, not a whole tensor's copy
_DEVICE_CHUNK = 1 << 26  # on a GPU: 512 MiB of float64 at most, a few launches per tensor
# Relative tolerance of the sums: float64 sums of up to ~1e9 terms in different orders differ
# by far less (pairwise summation: ~log2(n) * 1e-16 of the sum of |x|); a changed element moves
# them by its own size, which on any real weight is far above this.
RTOL = 1e-9


class SyncVerificationError(RunError):
    """A receiver's fingerprint of its weights differs from the trainer's of what it was sent:
    the sync landed partly (``layer``: the first such key)."""

    def __init__(self, message: str, layer: str = "") -> None:
        super().__init__(message)
        self.layer = layer

    def __reduce__(self) -> tuple:  # travels between ranks (the engines' exchange) as it is
        return (type(self), (str(self), self.layer))

    def at_step(self, rl_step: int) -> SyncVerificationError:
        """The same error, naming the RL step after which the sync ran."""
        return SyncVerificationError(f"after RL step {rl_step}: {self}", self.layer)


def layer_key(name: str) -> str:
    """The fingerprint key of parameter ``name`` (module docstring). A module wrapped by an
    adapter keeps its key: ``embed_tokens.base_layer`` (vLLM's and peft's LoRA wrappers) is
    ``embed_tokens``."""
    name = name.replace(".base_layer.", ".")
    m = _LAYER.search(name)
    if m is not None:
        return f"layer {m.group(1)}"
    module = name.rsplit(".", 1)[0] if "." in name else name
    return module.removeprefix("model.")


def tensor_stats(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Stats:
    """The statistics of ``tensor`` (cast to ``dtype`` first, when given), in float64. On the
    CPU in chunks that stay in the cache (the cost is about one read of the tensor); on a GPU in
    one pass of `fingerprint_triton` (`_device_stats` where it does not apply)."""
    if tensor.device.type != "cpu":
        if _kernel_takes(tensor, dtype):
            fp = Fingerprint(dtype)
            fp.add_many([("t", tensor)])
            return fp.keys["t"]
        return _device_stats(tensor, dtype)
    flat = tensor.detach().reshape(-1)
    total, squares, peak = 0.0, 0.0, 0.0
    for chunk in flat.split(_CHUNK):
        if dtype is not None and chunk.dtype != dtype:
            chunk = chunk.to(dtype)
        if chunk.numel():  # max |x| is exact in the tensor's own dtype
            low, high = torch.aminmax(chunk)
            peak = max(peak, -float(low), float(high))
        c = chunk.to(torch.float64)
        total += float(c.sum())
        squares += float(torch.dot(c, c))  # x^2 of a float32 is exact in float64
    return float(flat.numel()), total, squares, peak


def _kernel_takes(tensor: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether the one-pass GPU kernel applies (a CUDA tensor, Triton importable)."""
    if tensor.device.type != "cuda":
        return False
    try:
        from unirl.core.weights.fingerprint_triton import can_accumulate
    except ImportError:  # no Triton on this machine: the torch path
        return False
    return can_accumulate(tensor, dtype)


def _device_stats(tensor: torch.Tensor, dtype: torch.dtype | None) -> Stats:
    """`tensor_stats` on a GPU: the sums accumulate on the device in large chunks and reach the
    host once per tensor (the CPU path's per-chunk ``float()`` would wait for the GPU some
    thousand times per 7B model)."""
    flat = tensor.detach().reshape(-1)
    acc = torch.zeros(3, dtype=torch.float64, device=flat.device)  # sum, sum x^2, max |x|
    for chunk in flat.split(_DEVICE_CHUNK):
        if dtype is not None and chunk.dtype != dtype:
            chunk = chunk.to(dtype)
        if not chunk.numel():
            continue
        c = chunk.to(torch.float64)
        low, high = torch.aminmax(chunk)
        peak = torch.maximum(-low, high).to(torch.float64)
        acc += torch.stack((c.sum(), torch.dot(c, c), torch.zeros_like(peak)))
        acc[2] = torch.maximum(acc[2], peak)
    total, squares, peak_abs = acc.tolist()
    return float(flat.numel()), total, squares, peak_abs


def merge(a: Stats, b: Stats) -> Stats:
    """Two parts of one key (tensors of one layer, tensor-parallel shards)."""
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], max(a[3], b[3])


class Fingerprint:
    """Per-key statistics, accumulated tensor by tensor; ``dtype``: what each tensor is cast to
    before it counts (the receiver's dtype), None: as it is. GPU tensors accumulate on their
    device and reach the host together, at the first read of ``keys`` (one wait per
    fingerprint, not one per tensor)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self._keys: dict[str, Stats] = {}
        self._device: dict[torch.device, Any] = {}  # a GPU's `DeviceSums`, not read yet
        self.seconds = 0.0  # spent in `fingerprinted`

    @property
    def keys(self) -> dict[str, Stats]:
        self._flush()
        return self._keys

    @keys.setter
    def keys(self, value: dict[str, Stats]) -> None:
        self._device.clear()
        self._keys = value

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_many([(layer_key(name), tensor)])

    def add_tensor(self, key: str, tensor: torch.Tensor) -> None:
        """``tensor``'s statistics into ``key``'s."""
        self.add_many([(key, tensor)])

    def add_named(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each (parameter name, tensor): on a GPU in one launch per dtype (a bucket)."""
        self.add_many([(layer_key(name), tensor) for name, tensor in named])

    def add_many(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Each (key, tensor) of ``items``; the GPU ones accumulate on their device."""
        on_gpu: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for key, tensor in items:
            if _kernel_takes(tensor, self.dtype):
                on_gpu.setdefault(tensor.device, []).append((key, tensor))
            else:
                self.add_stats(key, tensor_stats(tensor, self.dtype))
        if not on_gpu:
            return
        from unirl.core.weights.fingerprint_triton import DeviceSums

        for device, group in on_gpu.items():
            if device not in self._device:
                self._device[device] = DeviceSums(device)
            self._device[device].add(group, self.dtype)

    def add_stats(self, key: str, stats: Stats) -> None:
        old = self._keys.get(key)
        self._keys[key] = stats if old is None else merge(old, stats)

    def _flush(self) -> None:
        """The GPUs' sums to the host: one copy per device."""
        devices, self._device = self._device, {}
        for sums in devices.values():
            for key, stats in sums.read().items():
                self.add_stats(key, stats)

    @classmethod
    def of(cls, parts: Iterable[Mapping[str, Stats]]) -> Fingerprint:
        """One fingerprint from several shards' (each a key -> stats mapping)."""
        out = cls()
        for part in parts:
            for key, stats in part.items():
                out.add_stats(key, tuple(float(s) for s in stats))  # type: ignore[arg-type]
        return out


def module_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """The fingerprint of an in-process model's parameters under their Hugging Face names (the
    sampler's copy of the policy); a tied tensor counts once, under its first name."""
    out = Fingerprint()
    with torch.no_grad():
        for name, param in model.named_parameters():
            out.add(name, param)
    return out


def fingerprinted(buckets: Iterable[list], seen: Fingerprint) -> Iterator[list]:
    """``buckets`` as they are, each one added to ``seen`` before it is handed on (the trainer's
    side: what the receiver was sent)."""
    for bucket in buckets:
        t0 = time.perf_counter()
        seen.add_named(bucket)
        seen.seconds += time.perf_counter() - t0
        yield bucket
        del bucket
    t0 = time.perf_counter()
    seen.keys  # noqa: B018 -- the GPU's pending sums, so that ``seconds`` holds their time
    seen.seconds += time.perf_counter() - t0


def _close(a: Stats, b: Stats) -> bool:
    if a[0] != b[0]:
        return False
    # |x| summed bounds the rounding of sum x; x^2 summed bounds its own
    scale = max(a[2], b[2], 0.0)
    abs_scale = math.sqrt(scale * a[0]) if a[0] else 0.0  # >= sum |x| (Cauchy-Schwarz)
    return (
        abs(a[1] - b[1]) <= RTOL * abs_scale + 1e-300
        and abs(a[2] - b[2]) <= RTOL * scale + 1e-300
        and abs(a[3] - b[3]) <= RTOL * max(a[3], b[3]) + 1e-300
    )


def _untie(sent: dict[str, Stats], held: Mapping[str, Stats]) -> None:
    """A receiver that ties its output head to the embedding holds one tensor for both: a head
    sent with exactly the embedding's values is then not a name it lacks."""
    tied = "lm_head" in sent and "lm_head" not in held and "embed_tokens" in sent
    if tied and _close(sent["lm_head"], sent["embed_tokens"]):
        del sent["lm_head"]


def _show(s: Stats) -> str:
    return f"n={int(s[0])}, sum={s[1]:.9g}, sum_sq={s[2]:.9g}, max_abs={s[3]:.6g}"


def compare(
    sent: Fingerprint,
    held: Fingerprint,
    *,
    receiver: str,
    version: int,
    what: str = "weight sync",
) -> None:
    """Raise `SyncVerificationError` unless ``held`` (the receiver's) matches ``sent`` (the
    trainer's) on every key, with the same keys on both sides. ``what``: the sync's kind, as
    the error names it (``adapter sync``; ``base weights`` for the check that an adapter sync
    left them alone)."""
    expected = dict(sent.keys)
    _untie(expected, held.keys)
    what = f"the {what} of policy version {version} to {receiver}"
    missing = sorted(set(held.keys) - set(expected))
    if missing:
        raise SyncVerificationError(
            f"{what} left {missing[:5]} unwritten: the receiver has them, the trainer's stream "
            "has no tensor for them (their names differ between the backend's export and the "
            "receiver's model, or the stream skips them); check the backend's Hugging Face "
            "names for these layers",
            missing[0],
        )
    extra = sorted(set(expected) - set(held.keys))
    if extra:
        raise SyncVerificationError(
            f"{what}: the trainer sent {extra[:5]}, which the receiver does not hold (a name "
            "the receiver's model does not know, or a model built from another config); check "
            "the backend's Hugging Face names and model.hf_config / model.path",
            extra[0],
        )
    for key in sorted(expected, key=_order):
        if not _close(expected[key], held.keys[key]):
            raise SyncVerificationError(
                f"{what} did not land: {key} holds other weights than were sent (sent "
                f"{_show(expected[key])}; held {_show(held.keys[key])}). A bucket was lost, cut "
                "or altered on the way, or the receiver did not load it; check the source's "
                "weight transfer (its rollout section; unirl check prints it) and the receiver's "
                "log (logging.level: DEBUG). "
                "The newest complete checkpoint is intact: run again with --resume",
                key,
            )


def _order(key: str) -> tuple[int, int, str]:
    """Layers in model order, other keys after them by name."""
    m = re.fullmatch(r"layer (\d+)", key)
    return (0, int(m.group(1)), "") if m else (1, 0, key)
