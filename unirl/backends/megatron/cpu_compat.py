"""megatron-core's schedules, DDP and optimizer on CPU processes over gloo: the few lines of
megatron-core that hard-code CUDA, and what they get instead when the backend runs on the CPU.

The Megatron backend on the CPU runs megatron's own code path (the same
`get_forward_backward_func` schedules, `DistributedDataParallel`, grad buffers, optimizer and
gradient clipping as on a GPU); only the lines below differ, and only on the CPU. Two kinds of
patch, both reversible and both applied to named megatron-core modules only (torch itself is
never changed outside a patched call):

- `_HostTorch`: a module's global name ``torch`` is replaced by a stand-in that forwards every
  attribute to torch except ``torch.cuda`` (``current_device()`` is the CPU, ``synchronize()``
  and ``empty_cache()`` do nothing, the only streams are the CPU's) and the factories ``zeros`` /
  ``empty`` / ``tensor``, which build on the CPU when asked for ``device="cuda"``. The lines
  this changes are listed per module in `PATCHES` (every ``cuda`` in those modules that the
  backend reaches).
- `_cpu_tensor_type_names`: around the listed functions, ``Tensor.type()`` of a CPU tensor
  answers the CUDA name (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``), because those
  functions dispatch on the name string and raise on anything else.

`install()` refuses any megatron-core version but the ones in `CHECKED_VERSIONS`: another
version may have moved a ``cuda`` line this list does not know, and a CPU run would then fail
far from the cause (or a CUDA-only line would slip through unpatched).
Call `install()` only when the backend's device is the CPU; on a GPU nothing here runs.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

logger = logging.getLogger(__name__)

# The megatron-core versions whose source the line lists below were read from and run against.
CHECKED_VERSIONS = ("0.16.1",)

_CPU = torch.device("cpu")


# -- the stand-in for a module's ``torch`` ------------------------------------------------------


# "file:line" (under megatron/core) of every patched line that ran in this process: the tests
# check each is listed in `PATCHES`.
_REACHED: set[str] = set()


def _record(depth: int) -> None:
    frame = sys._getframe(depth + 1)
    path = frame.f_code.co_filename
    marker = f"{os.sep}megatron{os.sep}core{os.sep}"
    if marker in path:
        _REACHED.add(f"{path.split(marker, 1)[1]}:{frame.f_lineno}")


def reached_lines() -> set[str]:
    """The patched megatron-core lines that ran in this process (``"file.py:line"``)."""
    return set(_REACHED)


def _host_device(device: Any) -> Any:
    """``"cuda"``, ``"cuda:N"``, ``torch.device("cuda", N)`` -> the CPU; anything else as is."""
    if device is None or torch.device(device).type != "cuda":
        return device
    _record(2)
    return _CPU


def _recorded(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        _record(1)
        return fn(*args, **kwargs)

    return call


class _HostStream:
    """The CPU's one stream: waiting on it and switching to it are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _HostCuda(types.SimpleNamespace):
    """What the patched modules see as ``torch.cuda``."""

    def __init__(self) -> None:
        super().__init__(
            current_device=_recorded(lambda: _CPU),
            synchronize=_recorded(lambda device=None: None),
            empty_cache=_recorded(lambda: None),
            is_available=_recorded(lambda: False),
            Stream=_recorded(_HostStream),
            default_stream=_recorded(lambda device=None: _HostStream()),
            current_stream=_recorded(lambda device=None: _HostStream()),
            stream=_recorded(lambda stream=None: contextlib.nullcontext()),
        )

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"torch.cuda.{name} reached from megatron-core on the CPU: "
            "unirl.backends.megatron.cpu_compat does not cover it"
        )


def _on_host(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _host_device(kwargs["device"])
        return factory(*args, **kwargs)

    return build


class _HostTorch(types.ModuleType):
    """``torch`` for a patched module: see the module docstring."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _HostCuda()
        self.zeros = _on_host(torch.zeros)
        self.empty = _on_host(torch.empty)
        self.tensor = _on_host(torch.tensor)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# -- Tensor.type() names -----------------------------------------------------------------------

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cpu_tensor_type_names() -> Iterator[None]:
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
        if dtype is None and not kw:
            name = original(self)
            if name in _CUDA_TYPE_NAMES:
                _record(1)
            return _CUDA_TYPE_NAMES.get(name, name)
        return original(self, dtype, non_blocking, **kw)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cpu_type_names(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _cpu_tensor_type_names():
            return fn(*args, **kwargs)

    wrapped.__unirl_cpu_compat__ = fn  # type: ignore[attr-defined]
    return wrapped


# -- the list --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ModulePatch:
    """megatron-core module whose ``torch`` becomes `_HostTorch`, and the lines that changes."""

    module: str
    lines: tuple[str, ...]  # "line: code  -- why", megatron-core 0.16.1


@attrs.frozen(kw_only=True)
class FunctionPatch:
    """A module-level function name (``module.name``, where callers look it up) whose function
    runs with ``torch`` bound to `_HostTorch`, its code unchanged: for a function of a module
    too widely used to patch whole (``megatron.core.utils``)."""

    module: str
    name: str
    lines: tuple[str, ...]


@attrs.frozen(kw_only=True)
class TypeNamePatch:
    """A function (``Class.method``) run with `_cpu_tensor_type_names`, and its lines."""

    module: str
    qualname: str
    lines: tuple[str, ...]


PATCHES: tuple[ModulePatch | FunctionPatch | TypeNamePatch, ...] = (
    ModulePatch(module="megatron.core.pipeline_parallel.schedules", lines=()),
    ModulePatch(module="megatron.core.pipeline_parallel.p2p_communication", lines=()),
    ModulePatch(module="megatron.core.distributed.param_and_grad_buffer", lines=()),
    ModulePatch(module="megatron.core.distributed.distributed_data_parallel", lines=()),
    ModulePatch(module="megatron.core.optimizer.clip_grads", lines=()),
    ModulePatch(module="megatron.core.optimizer.optimizer", lines=()),
    ModulePatch(module="megatron.core.optimizer.distrib_optimizer", lines=()),
    FunctionPatch(module="megatron.core.optimizer.clip_grads", name="l2_norm_impl", lines=()),
    ModulePatch(module="megatron.core.dist_checkpointing.strategies.filesystem_async", lines=()),
    ModulePatch(module="megatron.core.dist_checkpointing.strategies.state_dict_saver", lines=()),
    TypeNamePatch(
        module="megatron.core.optimizer.optimizer",
        qualname="clip_grad_by_total_norm_fp32",
        lines=(),
    ),
    TypeNamePatch(
        module="megatron.core.optimizer.distrib_optimizer",
        qualname="DistributedOptimizer.__init__",
        lines=(),
    ),
)


# -- installing --------------------------------------------------------------------------------

_installed = False


def check_version() -> str:
    """megatron-core's version, if it is one of `CHECKED_VERSIONS`; raises otherwise."""
    from megatron.core import package_info

    version = package_info.__version__
    if version not in CHECKED_VERSIONS:
        raise RuntimeError(
            f"unirl's CPU compatibility layer for megatron-core was checked against "
            f"{', '.join(CHECKED_VERSIONS)}, found megatron-core {version}: install "
            f"megatron-core=={CHECKED_VERSIONS[-1]} to run backend: megatron on the CPU "
            "(on a GPU any supported version runs unpatched), or re-check the lines listed in "
            "unirl/backends/megatron/cpu_compat.py against the new version"
        )
    return version


def install() -> None:
    """Apply every patch of `PATCHES` (idempotent). Only for a backend on the CPU."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "cpu_compat.install() called on a machine with CUDA: megatron-core runs unpatched "
            "on GPUs"
        )
    version = check_version()
    host_torch = _HostTorch()
    for patch in PATCHES:
        module = importlib.import_module(patch.module)
        if isinstance(patch, ModulePatch):
            assert module.torch is torch, (patch.module, module.torch)
            module.torch = host_torch
        elif isinstance(patch, FunctionPatch):
            fn = getattr(module, patch.name)
            rebound = types.FunctionType(
                fn.__code__, {**fn.__globals__, "torch": host_torch}, fn.__name__, fn.__defaults__
            )
            setattr(module, patch.name, functools.wraps(fn)(rebound))
        else:
            owner_name, _, attr = patch.qualname.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            original = owner.__dict__[attr]
            if isinstance(original, staticmethod):
                setattr(owner, attr, staticmethod(_with_cpu_type_names(original.__func__)))
            else:
                setattr(owner, attr, _with_cpu_type_names(original))
    _installed = True
    logger.info(
        "megatron-core %s on the CPU: %d CUDA-only lines patched (unirl.backends.megatron."
        "cpu_compat)",
        version,
        sum(len(p.lines) for p in PATCHES),
    )
