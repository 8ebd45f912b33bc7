"""megatron-core's schedules, DDP and optimizer on CPU processes over gloo: the few lines of
megatron-core 0.16.1 that hard-code CUDA, and what they get instead when the backend runs on the
CPU.

The Megatron backend on the CPU runs megatron's own code path (the same
`get_forward_backward_func` schedules, p2p communication, `DistributedDataParallel` and its grad
buffers, optimizer, gradient clipping and distributed checkpointing as on a GPU); only the lines
listed in `PATCHES` differ, and only on the CPU. Three kinds of patch, each applied to one named
megatron-core module attribute (torch itself is never changed outside a patched call):

- `ModulePatch`: the module's global name ``torch`` becomes `_HostTorch`, which forwards every
  attribute to torch except ``torch.cuda`` (``current_device()`` is the CPU, ``synchronize()``
  does nothing; any other ``torch.cuda`` attribute raises, naming this file)
  and the factories ``zeros`` / ``empty`` / ``tensor``, which build on the CPU when asked for
  ``device="cuda"`` and are unchanged otherwise.
- `FunctionPatch`: one function of a module too widely used to patch whole
  (``megatron.core.utils``) runs, code unchanged, with ``torch`` bound to `_HostTorch`.
- `ReplacePatch`: one function, as one module looks it up, replaced by a CPU version that
  differs from it only in the listed lines: a test on ``tensor.is_cuda``, which no stand-in for
  ``torch`` can answer, and the MoE dispatcher's uneven all-gather / reduce-scatter, which NCCL
  runs and gloo refuses (its all-gather needs equal sizes); each such line reads the name given
  in ``reads`` instead of ``cuda``.
- `TypeNamePatch`: during one function, ``Tensor.type()`` of a CPU tensor answers the CUDA name
  (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``), because it dispatches on the name string
  and raises on anything else.

Each patched line that runs is recorded (`reached_lines`); the contract tests check it is listed.
`install()` refuses any megatron-core version but `CHECKED_VERSIONS`: another version may move or
add a CUDA line, and the CPU run would then fail far from the cause. The backend calls
`install()` only when its device is the CPU; on a GPU nothing here runs (and `install()` refuses
to run where CUDA is available). bf16 on the CPU is not covered (megatron's mixed-precision
optimizer has more such lines); the CPU runs are fp32.
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


class _HostEvent:
    """A CUDA event's stand-in: work on the CPU is done when it is issued."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        _record(1)


class _HostStream:
    """The one CUDA stream's stand-in: CPU work runs in issue order, so waiting on a stream and
    recording an event on it have nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        _record(1)

    def record_event(self, event: Any = None) -> _HostEvent:
        _record(1)
        return _HostEvent()


_HOST_STREAM = _HostStream()


class _HostCuda(types.SimpleNamespace):
    """What the patched modules see as ``torch.cuda``: the calls the listed lines make."""

    def __init__(self) -> None:
        super().__init__(
            current_device=_recorded(lambda: _CPU),  # buffers go to the CPU
            synchronize=_recorded(lambda device=None: None),  # gloo's waits already block
            # one stream: the MoE dispatcher's side stream for its device-to-host copies is the
            # current stream (its copies are host-to-host no-ops on the CPU)
            Stream=_recorded(lambda *args, **kwargs: _HOST_STREAM),
            current_stream=_recorded(lambda device=None: _HOST_STREAM),
            stream=_recorded(lambda stream=None: contextlib.nullcontext()),
        )

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"torch.cuda.{name} reached from megatron-core on the CPU: "
            "unirl.backends.megatron.compat.cpu does not cover it (see its PATCHES)"
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
    reads: str = "cuda"  # what each listed line reads (the tests check it)


@attrs.frozen(kw_only=True)
class FunctionPatch:
    """A module-level function name (``module.name``, where callers look it up) whose function
    runs with ``torch`` bound to `_HostTorch`, its code unchanged: for a function of a module
    too widely used to patch whole (``megatron.core.utils``)."""

    module: str
    name: str  # a function, or ``Class.method``
    lines: tuple[str, ...]


@attrs.frozen(kw_only=True)
class ReplacePatch:
    """``module.name`` (where callers look it up) replaced by ``replacement``."""

    module: str
    name: str  # a function, or ``Class.method``
    replacement: Callable[..., Any]
    lines: tuple[str, ...]
    reads: str = "cuda"  # what each listed line reads (the tests check it)


def _host_maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors already on the CPU: its test
    ``tensor.is_cuda`` (line 1093) is what lets the all-to-all dispatcher's split sizes become
    the numpy arrays ``all_to_all_single`` takes; on the CPU every tensor is the "device" one."""
    if torch.is_tensor(tensor):
        _REACHED.add("transformer/moe/moe_utils.py:1093")
        tensor = tensor.clone()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _host_gather_along_first_dim(
    input_: torch.Tensor,
    group: Any,
    output_split_sizes: Any = None,
    use_global_buffer: bool = False,
) -> torch.Tensor:
    """``mappings._gather_along_first_dim`` with uneven sizes on gloo: line 150's
    ``all_gather`` into views of different lengths becomes an all-gather of copies padded to the
    longest, trimmed after; even sizes go to the original."""
    if output_split_sizes is None or group.size() == 1:
        return _ORIGINALS["_gather_along_first_dim"](input_, group, None, use_global_buffer)
    _REACHED.add("tensor_parallel/mappings.py:150")
    sizes = [int(n) for n in output_split_sizes]
    padded = input_.new_zeros(max(sizes), *input_.shape[1:])
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


def _host_reduce_scatter_along_first_dim(
    input_: torch.Tensor, group: Any, input_split_sizes: Any = None, use_global_buffer: bool = False
) -> torch.Tensor:
    """``mappings._reduce_scatter_along_first_dim`` with uneven sizes on gloo (line 193's
    ``reduce_scatter`` of a list): the sum by all-reduce, then this rank's rows."""
    if input_split_sizes is None or group.size() == 1:
        return _ORIGINALS["_reduce_scatter_along_first_dim"](input_, group, None, use_global_buffer)
    _REACHED.add("tensor_parallel/mappings.py:193")
    sizes = [int(n) for n in input_split_sizes]
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    return total.split(sizes)[group.rank()].clone()


def _host_get_cuda_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> Any:
    """``random._get_cuda_rng_state`` on the CPU: the CPU generator stands for the device's, so
    activation recompute (`CheckpointFunction`, selective recompute's `CheckpointWithoutOutput`)
    saves and restores it around the recomputed forward; line 55 reads the CUDA generator."""
    _REACHED.add("tensor_parallel/random.py:55")
    return torch.get_rng_state()


def _host_set_cuda_rng_state(
    new_state: torch.Tensor, device: int = -1, graph_safe: bool = False
) -> None:
    """``random._set_cuda_rng_state`` on the CPU: sets the CPU generator (line 93 names the CUDA
    device whose generator the original sets, through a call queued until CUDA initialises,
    which on the CPU never runs)."""
    _REACHED.add("tensor_parallel/random.py:93")
    torch.set_rng_state(new_state)


def _host_sub_optimizer_param_groups(self: Any, offload_fraction: float) -> tuple[Any, ...]:
    """``HybridDeviceOptimizer._get_sub_optimizer_param_groups`` on the CPU (``optimizer.offload``):
    every parameter counts as the device's (lines 256, 273 and 285 test ``param.is_cuda``), so
    the offloaded ones get their own host copy (``clone()``, line 274's ``pin_memory()`` left
    out: there is no device to pin for) that the host AdamW steps and the step's hook copies
    back, as on a GPU. Otherwise line for line the original."""
    _REACHED.update(f"optimizer/cpu_offloading/hybrid_optimizer.py:{n}" for n in (256, 273, 285))
    params = [p for group in self.param_groups for p in group["params"]]
    threshold = sum(p.numel() for p in params) * offload_fraction
    offloaded = 0
    cpu_groups, gpu_groups = [], []
    to_copy, from_copy, to_fp32 = {}, {}, {}
    for group in self.param_groups:
        gpu_group, cpu_group = {**group, "params": []}, {**group, "params": []}
        for orig in group["params"]:
            param, copied = orig, False
            if offloaded < threshold:
                param = param.detach().clone()
                offloaded += param.numel()
                copied = True
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                to_fp32[orig] = param
            if copied:
                to_copy[orig] = param
                from_copy[param] = orig
            (cpu_group if copied else gpu_group)["params"].append(param)
        if gpu_group["params"]:
            gpu_groups.append(gpu_group)
        if cpu_group["params"]:
            cpu_groups.append(cpu_group)
    return cpu_groups, gpu_groups, to_copy, from_copy, to_fp32


def _host_model_and_main_param_groups(
    cls: Any, gbuf_ranges: Any, param_gbuf_map: Any, opt_group_ranges: Any, config: Any
) -> tuple[Any, ...]:
    """``DistributedOptimizer._build_model_and_main_param_groups`` for fp32 parameters (every CPU
    run's) under ``optimizer.offload``: the shard of an fp32 parameter is a view the autograd
    graph tracks (line 421, ``model_param.view(-1)[...]``; a bf16 one is detached, line 367), and
    torch's Optimizer refuses such a tensor when megatron rebuilds its HybridDeviceOptimizer over
    the shards. Each is replaced by its detached view (the same storage, its tensor-parallel
    attributes kept) in the shard groups and the optimizer's groups alike."""
    from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

    original = _ORIGINALS["DistributedOptimizer._build_model_and_main_param_groups"]
    groups = original.__func__(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
    if not config.optimizer_cpu_offload:
        return groups
    _REACHED.add("optimizer/distrib_optimizer.py:421")
    shard_fp32_groups = groups[3]
    for group_range, shards in zip(opt_group_ranges, shard_fp32_groups):
        detached = {}
        for i, shard in enumerate(shards):
            leaf = shard.detach()
            copy_tensor_model_parallel_attributes(leaf, shard)
            if hasattr(shard, "shared"):
                leaf.shared = shard.shared
            detached[id(shard)] = shards[i] = leaf
        params = group_range["orig_group"]["params"]
        params[:] = [detached.get(id(q), q) for q in params]
    return groups


# the functions a `ReplacePatch` replaced, by name (its replacement calls them for what it keeps)
_ORIGINALS: dict[str, Callable[..., Any]] = {}


@attrs.frozen(kw_only=True)
class TypeNamePatch:
    """A function (``Class.method``) run with `_cpu_tensor_type_names`, and its lines."""

    module: str
    qualname: str
    lines: tuple[str, ...]


# Every line below is "file:line" under megatron/core in megatron-core 0.16.1, the line's code in
# the comment beside it. The tests run every contract layout on the CPU and check that each
# patched line that ran is listed here, and that each listed line still reads ``cuda``.
PATCHES: tuple[ModulePatch | FunctionPatch | ReplacePatch | TypeNamePatch, ...] = (
    ModulePatch(
        module="megatron.core.pipeline_parallel.schedules",
        lines=(
            # total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda"): the token count
            # each schedule sums the loss functions' optional token numbers into
            "pipeline_parallel/schedules.py:596",  # forward_backward_no_pipelining
            "pipeline_parallel/schedules.py:983",  # forward_backward_pipelining_with_interleaving
            "pipeline_parallel/schedules.py:2138",  # ..._pipelining_without_interleaving
        ),
    ),
    ModulePatch(
        module="megatron.core.pipeline_parallel.p2p_communication",
        lines=(
            # torch.empty(recv_shape, ..., device=torch.cuda.current_device()): the buffers a
            # stage receives activations (prev) and gradients (next) into
            "pipeline_parallel/p2p_communication.py:313",
            "pipeline_parallel/p2p_communication.py:321",
            # torch.cuda.synchronize() after batched isend/irecv (``batch_p2p_sync``): a CUDA
            # stream race; gloo's requests are complete once waited on
            "pipeline_parallel/p2p_communication.py:398",
        ),
    ),
    ModulePatch(
        module="megatron.core.distributed.param_and_grad_buffer",
        lines=(
            # torch.zeros(numel, ..., device=torch.cuda.current_device()): DDP's contiguous
            # parameter (distributed optimizer only) and gradient buffers
            "distributed/param_and_grad_buffer.py:800",
            "distributed/param_and_grad_buffer.py:806",
        ),
    ),
    FunctionPatch(
        module="megatron.core.optimizer.clip_grads",
        name="l2_norm_impl",  # megatron.core.utils.local_multi_tensor_l2_norm without TE / Apex
        lines=(
            # torch.tensor([float(l2_reduced)], ..., device="cuda"): the local gradient norm
            "utils.py:1207",
        ),
    ),
    ModulePatch(
        module="megatron.core.optimizer.clip_grads",
        lines=(
            # torch.zeros(1, dtype=torch.int, device='cuda'): the multi-tensor applier's overflow
            # flag, in get_grad_norm_fp32 and clip_grad_by_total_norm_fp32
            "optimizer/clip_grads.py:103",
            "optimizer/clip_grads.py:174",
        ),
    ),
    TypeNamePatch(
        module="megatron.core.optimizer.optimizer",  # where the optimizer looks it up
        qualname="clip_grad_by_total_norm_fp32",
        lines=(
            # assert param.grad.type() == 'torch.cuda.FloatTensor'
            "optimizer/clip_grads.py:167",
        ),
    ),
    ModulePatch(
        module="megatron.core.optimizer.optimizer",
        lines=(
            # MixedPrecisionOptimizer.__init__ (the distributed optimizer's base):
            # torch.tensor([0], dtype=torch.int, device='cuda'), torch.tensor([1.0], ...,
            # device='cuda'): the overflow flag and the unit loss scale
            "optimizer/optimizer.py:481",
            "optimizer/optimizer.py:485",
            # FP32Optimizer.__init__: self._scale = torch.tensor([1.0], ..., device='cuda')
            "optimizer/optimizer.py:907",
        ),
    ),
    TypeNamePatch(
        module="megatron.core.optimizer.distrib_optimizer",
        qualname="DistributedOptimizer.__init__",
        lines=(
            # _build_model_and_main_param_groups sorts parameters by type name and raises on
            # any other: model_param.type() in ['torch.cuda.HalfTensor', ...BFloat16Tensor'],
            # model_param.type() == 'torch.cuda.FloatTensor'
            "optimizer/distrib_optimizer.py:361",
            "optimizer/distrib_optimizer.py:420",
            # __init__: param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']
            "optimizer/distrib_optimizer.py:582",
        ),
    ),
    # parallel.sequence_parallel (`unirl.backends.megatron.compat.sequence_parallel`): the outputs of
    # the sequence all-gather and reduce-scatter, mappings.py:141 / :181, patched by the one
    # ModulePatch of tensor_parallel.mappings below (a module's torch is replaced once)
    ModulePatch(
        module="megatron.core.tensor_parallel.layers",
        lines=(
            # LinearWithGradAccumulationAndAsyncCommunication.backward: sub_grad_input =
            # torch.empty(dim_size, ..., device=torch.cuda.current_device()), the reduce-scattered
            # input gradient of a column-parallel linear
            "tensor_parallel/layers.py:552",
        ),
    ),
    FunctionPatch(
        module="megatron.core.utils",
        name="GlobalMemoryBuffer.get_tensor",
        lines=(
            # self.buffer[(name, dtype)] = torch.empty(..., device=torch.cuda.current_device()):
            # the all-gather buffer of a column-parallel linear's input
            "utils.py:631",
        ),
    ),
    ModulePatch(
        module="megatron.core.transformer.moe.router",
        lines=(
            # Router.gating: if self.weight.device.type == 'cpu': self.weight.data =
            # self.weight.data.to(device=torch.cuda.current_device()), the router weight moved
            # to the GPU on every forward (it stays on the CPU)
            "transformer/moe/router.py:90",
        ),
    ),
    ModulePatch(
        module="megatron.core.transformer.moe.token_dispatcher",
        lines=(
            # MoEAlltoAllTokenDispatcher.__init__: cuda_dtoh_stream = torch.cuda.Stream()
            "transformer/moe/token_dispatcher.py:445",
            # _maybe_dtoh_and_synchronize: on_side_stream = torch.cuda.current_stream() !=
            # self.cuda_dtoh_stream; with torch.cuda.stream(self.cuda_dtoh_stream): the
            # token counts' device-to-host copies on a side stream; then
            # self.d2h_event = self.cuda_dtoh_stream.record_event(), synchronized on later
            "transformer/moe/token_dispatcher.py:871",
            "transformer/moe/token_dispatcher.py:874",
            "transformer/moe/token_dispatcher.py:895",
        ),
    ),
    ReplacePatch(
        module="megatron.core.transformer.moe.token_dispatcher",
        name="maybe_move_tensor_to_cpu",
        replacement=_host_maybe_move_tensor_to_cpu,
        lines=(
            # if torch.is_tensor(tensor) and tensor.is_cuda: the token counts and all-to-all split
            # sizes copied to the host (as numpy arrays when asked)
            "transformer/moe/moe_utils.py:1093",
        ),
    ),
    ReplacePatch(
        module="megatron.core.tensor_parallel.random",
        name="_get_cuda_rng_state",
        replacement=_host_get_cuda_rng_state,
        # return torch.cuda.random.get_rng_state(device=device): the generator state activation
        # recompute saves before a checkpointed forward (megatron.recompute_modules,
        # model.gradient_checkpointing)
        lines=("tensor_parallel/random.py:55",),
    ),
    ReplacePatch(
        module="megatron.core.tensor_parallel.random",
        name="_set_cuda_rng_state",
        replacement=_host_set_cuda_rng_state,
        # device = torch.device('cuda'): the generator restored around the recomputed forward
        lines=("tensor_parallel/random.py:93",),
    ),
    ReplacePatch(
        module="megatron.core.tensor_parallel.mappings",
        name="_gather_along_first_dim",
        replacement=_host_gather_along_first_dim,
        # torch.distributed.all_gather(output_tensor_list, input_, group=group): the tokens
        # of the expert tensor-parallel ranks, gathered in their own (uneven) counts
        lines=("tensor_parallel/mappings.py:150",),
        reads="all_gather",
    ),
    ReplacePatch(
        module="megatron.core.tensor_parallel.mappings",
        name="_reduce_scatter_along_first_dim",
        replacement=_host_reduce_scatter_along_first_dim,
        # torch.distributed.reduce_scatter(output, input_tensor_list, group=group): the experts'
        # partial outputs summed back to the ranks their tokens came from (uneven counts)
        lines=("tensor_parallel/mappings.py:193",),
        reads="reduce_scatter",
    ),
    ModulePatch(
        module="megatron.core.tensor_parallel.mappings",
        lines=(
            # _AllToAll.forward: input.new_empty(..., device=torch.cuda.current_device()), the
            # all-to-all-v output of the expert-parallel token dispatch
            "tensor_parallel/mappings.py:442",
            # _gather_along_first_dim: torch.empty(dim_size, ..., device=
            # torch.cuda.current_device()), the dispatcher's gather of token counts over the
            # tensor x expert parallel ranks (equal and uneven splits), and sequence parallel's
            # all-gather
            "tensor_parallel/mappings.py:141",
            "tensor_parallel/mappings.py:148",
            # _reduce_scatter_along_first_dim (combine under tp > 1; sequence parallel between
            # the norms and the TP matmuls): the same allocation
            "tensor_parallel/mappings.py:181",
        ),
    ),
    # optimizer.offload: megatron-core's HybridDeviceOptimizer (unirl.backends.megatron.optimizer)
    ModulePatch(
        module="megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
        lines=(
            # _init_sub_optimizers: self._d2h_stream = self._h2d_stream =
            # torch.cuda.current_stream(), the streams the copies run on (no overlap on the CPU)
            "optimizer/cpu_offloading/hybrid_optimizer.py:217",
            "optimizer/cpu_offloading/hybrid_optimizer.py:218",
            # step: self._d2h_stream.wait_stream(torch.cuda.current_stream()); with
            # torch.cuda.stream(self._d2h_stream): the gradients' device-to-host copies
            "optimizer/cpu_offloading/hybrid_optimizer.py:162",
            "optimizer/cpu_offloading/hybrid_optimizer.py:163",
            # _set_sub_optimizer_grads: self._d2h_stream.record_event(), the copies' event
            "optimizer/cpu_offloading/hybrid_optimizer.py:115",
            # the host step's hook: the same for the weights' host-to-device copies, then
            # self._h2d_stream.record_event().wait(torch.cuda.current_stream())
            "optimizer/cpu_offloading/hybrid_optimizer.py:120",
            "optimizer/cpu_offloading/hybrid_optimizer.py:121",
            "optimizer/cpu_offloading/hybrid_optimizer.py:125",
        ),
        reads="stream",  # each line uses a CUDA stream (the one stream's stand-in on the CPU)
    ),
    ReplacePatch(
        module="megatron.core.optimizer.cpu_offloading.hybrid_optimizer",
        name="HybridDeviceOptimizer._get_sub_optimizer_param_groups",
        replacement=_host_sub_optimizer_param_groups,
        # param.is_cuda: which parameters are the device's, and so get a host copy
        lines=(
            "optimizer/cpu_offloading/hybrid_optimizer.py:256",
            "optimizer/cpu_offloading/hybrid_optimizer.py:273",
            "optimizer/cpu_offloading/hybrid_optimizer.py:285",
        ),
        reads="is_cuda",
    ),
    ReplacePatch(
        module="megatron.core.optimizer.distrib_optimizer",
        name="DistributedOptimizer._build_model_and_main_param_groups",
        replacement=classmethod(_host_model_and_main_param_groups),
        # shard_model_param = model_param.view(-1)[...]: an fp32 parameter's shard, not detached
        lines=("optimizer/distrib_optimizer.py:421",),
        reads="model_param.view(-1)",
    ),
    ModulePatch(
        module="megatron.core.dist_checkpointing.strategies.filesystem_async",
        lines=(
            # preload_tensors: torch.cuda.synchronize() before copying tensors to the host
            "dist_checkpointing/strategies/filesystem_async.py:230",
        ),
    ),
    ModulePatch(
        module="megatron.core.dist_checkpointing.strategies.state_dict_saver",
        lines=(
            # save_state_dict_async_finalize: torch.tensor([...], ...,
            # device=torch.cuda.current_device()), the all-reduced count of failed writes
            "dist_checkpointing/strategies/state_dict_saver.py:252",
        ),
    ),
)


def is_installed() -> bool:
    """Whether `install` patched megatron-core in this process."""
    return _installed


def listed_lines() -> set[str]:
    """Every ``"file.py:line"`` of `PATCHES`."""
    return {line for patch in PATCHES for line in patch.lines}


def line_reads() -> dict[str, str]:
    """What each listed line reads: ``cuda``, or the collective gloo runs differently."""
    return {line: getattr(patch, "reads", "cuda") for patch in PATCHES for line in patch.lines}


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
            "unirl/backends/megatron/compat/cpu.py against the new version"
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
        elif isinstance(patch, ReplacePatch):
            owner_name, _, attr = patch.name.rpartition(".")  # a function, or Class.method
            owner = getattr(module, owner_name) if owner_name else module
            _ORIGINALS[patch.name] = owner.__dict__[attr] if owner_name else getattr(owner, attr)
            setattr(owner, attr, patch.replacement)
        elif isinstance(patch, FunctionPatch):
            owner_name, _, attr = patch.name.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            fn = getattr(owner, attr)
            rebound = types.FunctionType(
                fn.__code__, {**fn.__globals__, "torch": host_torch}, fn.__name__, fn.__defaults__
            )
            setattr(owner, attr, functools.wraps(fn)(rebound))
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
