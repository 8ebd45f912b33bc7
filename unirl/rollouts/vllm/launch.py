"""What one engine starts with on its leader rank: its transport, its GPUs, the `vllm.LLM`
arguments and environment that follow from ``rollout.vllm`` (placement.py has the rules).

    launch = plan_launch(options, engine=k, cuda=torch.cuda.is_available(), local_rank=...,
                         world_size=..., local_world_size=...)
    VllmEngine.start(..., extra=launch.llm_kwargs(), env=launch.env)

On GPUs the engine gets ``gpu_memory_utilization``, sleep mode when asked, and for ``ipc`` /
``nccl`` vLLM's ``weight_transfer_config``; it then starts from dummy weights (the first sync
sends them all), so no file is written. On the CPU none of that applies: the engine loads the
safetensors folder and reloads it after every sync.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import attrs

from unirl.rollouts.serving import placement
from unirl.rollouts.vllm import sleep

if TYPE_CHECKING:  # plugin.py imports placement, not this module
    from unirl.rollouts.vllm.plugin import VllmOptions


@attrs.frozen(kw_only=True)
class EngineLaunch:
    engine: int
    transport: placement.Decision
    cuda: bool
    devices: tuple[int, ...] | None  # local GPU indices (None on the CPU)
    gpu_memory_utilization: float
    sleep: str
    env: dict[str, str]

    @property
    def loads_from_folder(self) -> bool:
        """Whether the engine starts from the weights folder (else from dummy weights)."""
        return self.transport.value == "file"

    def llm_kwargs(self) -> dict[str, Any]:
        if not self.cuda:
            return {}
        kwargs: dict[str, Any] = {
            "gpu_memory_utilization": self.gpu_memory_utilization,
            **sleep.engine_kwargs(self.sleep),
        }
        if not self.loads_from_folder:
            from vllm.config import WeightTransferConfig

            kwargs["weight_transfer_config"] = WeightTransferConfig(backend=self.transport.value)
            kwargs["load_format"] = "dummy"  # the first sync sends every weight
        return kwargs


def plan_launch(
    options: VllmOptions,
    *,
    engine: int,
    cuda: bool,
    local_rank: int,
    world_size: int,
    local_world_size: int,
) -> EngineLaunch:
    """Engine ``engine``'s launch, on its leader (local rank ``local_rank``)."""
    placement.check_startup(
        options, cuda=cuda, local_world_size=local_world_size, world_size=world_size
    )
    transport = placement.choose_transport(options.weight_transfer, options, cuda=cuda)
    env: dict[str, str] = {}
    devices = None
    if cuda:
        devices = placement.engine_devices(
            options,
            engine,
            leader_local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
        )
        env["CUDA_VISIBLE_DEVICES"] = placement.visible_devices(
            devices, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
    if transport.value == "ipc":
        # the IPC handles cross vLLM's msgpack channel pickled (transport.py)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return EngineLaunch(
        engine=engine,
        transport=transport,
        cuda=cuda,
        devices=devices,
        gpu_memory_utilization=options.gpu_memory_utilization,
        sleep=options.sleep,
        env=env,
    )
