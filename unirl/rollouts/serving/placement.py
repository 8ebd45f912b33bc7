"""Where the vLLM engines run and how the weights reach them: pure rules over ``rollout.vllm``,
the world size and the device, so `unirl check`, the start-up and the tests share them.

    leaders(engines=2, world_size=4)            # (0, 2): engine k is driven by rank k*world/N
    split_prompts(prompts=5, engines=2)         # [range(0, 3), range(3, 5)]
    choose_transport(options.weight_transfer, options, cuda=True)        # Decision("ipc", "the engine shares ...")

Placement. Engine k runs beside global rank ``k * world_size / engines`` (its leader), which
starts it, feeds it the weights and its share of the prompts. Colocated (``devices: null``) it
uses the GPU(s) of its leader and the next ``tensor_parallel_size - 1`` ranks, which the trainer
uses too: trainer and engine must fit on them (``gpu_memory_utilization``, ``sleep``). With
``devices`` (local GPU indices no trainer rank uses), the engines of a node take
``tensor_parallel_size`` of those each, in leader order.

Transports (transport.py). ``file``: safetensors in tmpfs, reloaded in place (the CPU's only
way). ``ipc``: CUDA IPC handles of a GPU buffer holding one bucket (the engine's GPU is the
trainer's). ``nccl``: a broadcast from the leader to the engine's workers (other GPUs). This
module imports neither torch nor vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from unirl.core.errors import ConfigError

_TRANSPORT_KEY = "rollout.vllm.weight_transfer"
GIB = 1 << 30


@attrs.frozen
class Decision:
    """A chosen value and why (``unirl check`` prints both)."""

    value: str
    reason: str


def leaders(engines: int, world_size: int) -> tuple[int, ...]:
    """The global rank that drives each engine: evenly spaced, rank 0 first."""
    check_engine_count(engines, world_size)
    step = world_size // engines
    return tuple(k * step for k in range(engines))


def engine_of(rank: int, engines: int, world_size: int) -> int | None:
    """The engine ``rank`` drives, or None when it drives none."""
    step = world_size // engines
    return rank // step if rank % step == 0 and rank // step < engines else None


def shares_engine_gpu(rank: int, engines: int, world_size: int, tensor_parallel_size: int) -> bool:
    """Whether a colocated engine uses ``rank``'s GPU: its leader's and the next
    ``tensor_parallel_size - 1`` ranks' (``leaders(engines=2, world_size=4)`` with TP 1: ranks 0
    and 2)."""
    step = world_size // engines
    return rank // step < engines and rank % step < tensor_parallel_size


def check_engine_count(engines: int, world_size: int) -> None:
    if world_size % engines:
        raise ConfigError(
            f"rollout.vllm.engines={engines} does not divide the {world_size} trainer "
            "processes: each engine is driven by one rank of an equal group of ranks; choose "
            f"a divisor of {world_size}"
        )


def split_prompts(prompts: int, engines: int) -> list[range]:
    """The rollout's prompts, in order, split into ``engines`` contiguous shares whose sizes
    differ by at most one (a prompt's samples stay on one engine: they share its prefix)."""
    if prompts < engines:
        raise ConfigError(
            f"batch.prompts_per_rollout={prompts} is fewer than rollout.vllm.engines={engines}: "
            "an engine would have nothing to generate; lower rollout.vllm.engines or raise "
            "batch.prompts_per_rollout"
        )
    base, extra = divmod(prompts, engines)
    out, start = [], 0
    for k in range(engines):
        n = base + (1 if k < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def choose_transport(want: str, options: Any, *, cuda: bool) -> Decision:
    """How each sync reaches the engines, from ``want`` (``rollout.vllm.weight_transfer``), the
    rest of ``options`` (`VllmOptions`) and whether the engines run on CUDA GPUs."""
    colocated = options.devices is None
    tp = options.tensor_parallel_size
    if want == "auto":
        if not cuda:
            return Decision("file", "auto: on the CPU, safetensors in tmpfs reloaded in place")
        if not colocated:
            return Decision("nccl", "auto: engines on devices of their own (rollout.vllm.devices)")
        if tp == 1:
            return Decision("ipc", "auto: each engine shares its leader's GPU (CUDA IPC)")
        return Decision(
            "file",
            f"auto: a colocated engine over {tp} GPUs (tensor_parallel_size) takes no one GPU's "
            "IPC handles and NCCL cannot join two processes of one GPU",
        )
    if want in ("ipc", "nccl") and not cuda:
        raise ConfigError(
            f"{_TRANSPORT_KEY}={want} needs CUDA GPUs, and this machine has none; set it to file "
            "or auto"
        )
    check_transport(options)
    return Decision(want, f"{_TRANSPORT_KEY}={want}")


def check_transport(options: Any) -> None:
    """The placement each explicit transport needs (also checked without a GPU, by the config)."""
    want, colocated = options.weight_transfer, options.devices is None
    if want == "ipc" and not colocated:
        raise ConfigError(
            f"{_TRANSPORT_KEY}=ipc shares the trainer's GPU memory with an engine on the same "
            f"GPU, but rollout.vllm.devices={list(options.devices)} puts the engines on other "
            "GPUs; use nccl (or auto) there, or devices: null to colocate"
        )
    if want == "ipc" and options.tensor_parallel_size > 1:
        raise ConfigError(
            f"{_TRANSPORT_KEY}=ipc sends one GPU's buffer, but rollout.vllm."
            f"tensor_parallel_size={options.tensor_parallel_size} spreads each engine over "
            "several GPUs; use file, or engines on devices of their own with nccl"
        )
    if want == "nccl" and colocated:
        raise ConfigError(
            f"{_TRANSPORT_KEY}=nccl broadcasts to an engine on other GPUs (NCCL cannot join "
            "two processes on one GPU), but rollout.vllm.devices is null (colocated); set "
            "rollout.vllm.devices to GPUs reserved for generation, or use ipc / auto"
        )


def check_startup(options: Any, *, cuda: bool, local_world_size: int, world_size: int) -> None:
    """Rules that need the machine: sleep mode and reserved devices exist only on GPUs; reserved
    devices must not be the trainer's and must hold every engine of the node."""
    if options.sleep != "off" and not cuda:
        raise ConfigError(
            f"rollout.vllm.sleep={options.sleep} needs vLLM's sleep mode, which vLLM offers on "
            "CUDA GPUs only, and this machine has none; set rollout.vllm.sleep: off"
        )
    if options.devices is None:
        if cuda and options.tensor_parallel_size > world_size // options.engines:
            raise ConfigError(
                f"rollout.vllm.tensor_parallel_size={options.tensor_parallel_size} > the "
                f"{world_size // options.engines} trainer GPUs of each colocated engine; lower "
                "it, lower rollout.vllm.engines, or reserve GPUs with rollout.vllm.devices"
            )
        return
    if not cuda:
        raise ConfigError(
            f"rollout.vllm.devices={list(options.devices)} names GPUs, and this machine has "
            "none; leave it null"
        )
    trainer = set(range(local_world_size))
    if trainer & set(options.devices):
        raise ConfigError(
            f"rollout.vllm.devices={list(options.devices)} includes GPUs of trainer ranks "
            f"(local GPUs {sorted(trainer)}); reserve others, or leave it null to colocate"
        )
    per_node = engines_per_node(options.engines, world_size, local_world_size)
    need = per_node * options.tensor_parallel_size
    if len(options.devices) < need:
        raise ConfigError(
            f"rollout.vllm.devices={list(options.devices)}: {per_node} engine(s) per node x "
            f"tensor_parallel_size={options.tensor_parallel_size} need {need} GPUs; list more or "
            "lower rollout.vllm.engines / tensor_parallel_size"
        )


def engines_per_node(engines: int, world_size: int, local_world_size: int) -> int:
    return max(1, engines * local_world_size // world_size)


def engine_devices(
    options: Any, engine: int, *, leader_local_rank: int, world_size: int, local_world_size: int
) -> tuple[int, ...]:
    """The local GPU indices engine ``engine`` runs on: its group's ranks' GPUs (colocated) or
    its share of ``rollout.vllm.devices``."""
    tp = options.tensor_parallel_size
    if options.devices is None:
        return tuple(range(leader_local_rank, leader_local_rank + tp))
    slot = engine % engines_per_node(options.engines, world_size, local_world_size)
    return tuple(options.devices[slot * tp : (slot + 1) * tp])


def visible_devices(local: tuple[int, ...], parent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine on the local GPUs ``local``: indices into the
    trainer's own CUDA_VISIBLE_DEVICES when it has one."""
    if parent_visible:
        physical = [d.strip() for d in parent_visible.split(",") if d.strip()]
        if max(local) >= len(physical):
            raise ConfigError(
                f"the engine's GPUs {list(local)} are beyond CUDA_VISIBLE_DEVICES="
                f"{parent_visible}; make those GPUs visible or fix rollout.vllm.devices"
            )
        return ",".join(physical[i] for i in local)
    return ",".join(str(i) for i in local)


def check_fit(
    *, free_bytes: int, total_bytes: int, utilization: float, device: str, sleep: str
) -> None:
    """vLLM starts only if ``utilization`` of the GPU is free (vllm/v1/worker/utils.py
    `request_memory`); say so before it does, with the knobs that make trainer and engine fit."""
    need = utilization * total_bytes
    if free_bytes >= need:
        return
    fits = max(0.0, free_bytes / total_bytes - 0.02)
    hint = (
        " or rollout.vllm.sleep: offload / discard (the engine then releases its memory "
        "while the trainer trains)"
        if sleep == "off"
        else ""
    )
    raise ConfigError(
        f"the vLLM engine cannot start on {device}: rollout.vllm.gpu_memory_utilization="
        f"{utilization:g} asks for {need / GIB:.1f} GiB of its {total_bytes / GIB:.1f} GiB, "
        f"but the trainer leaves {free_bytes / GIB:.1f} GiB free. Set "
        f"rollout.vllm.gpu_memory_utilization <= {fits:.2f} (and rollout.vllm.kv_cache_gb to "
        "what fits in it), reserve GPUs for generation with rollout.vllm.devices, or shrink "
        f"the trainer's memory (parallel.zero_stage, micro_batch_size){hint}"
    )


def check_engine_gpus_fit(
    devices: tuple[int, ...],
    mem_get_info: Callable[[int], tuple[int, int]],
    *,
    utilization: float,
    sleep: str,
) -> None:
    """`check_fit` on every GPU of a colocated engine (its tensor-parallel ranks' GPUs too,
    each shared with its own trainer rank): ``mem_get_info(index)`` -> (free, total) bytes."""
    for index in devices:
        free, total = mem_get_info(index)
        check_fit(
            free_bytes=free,
            total_bytes=total,
            utilization=utilization,
            device=f"cuda:{index}",
            sleep=sleep,
        )
