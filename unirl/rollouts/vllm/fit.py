"""The colocated fit check again after the trainer's first RL step (``rollout.vllm.devices:
null`` on a GPU): the check before the engine starts (`serving.placement.check_fit`) sees the
trainer at rest, before its first forward, its gradients and its optimizer state, so the
``gpu_memory_utilization`` it suggests can leave too little for the trainer's real peak.

After the first step of the run (or of a resumed run) every trainer rank whose GPU an engine
shares (its leader's and, under tensor parallel, the next ranks' GPUs) measures the trainer's peak
there (`cuda_peak`: what torch's caching allocator reserved at most, which it keeps and an engine
in another process cannot use) and adds the engine's allowance, ``gpu_memory_utilization`` x the
card. Past the card:

- with ``rollout.vllm.sleep`` on, the run **stops** before the weight sync after step 1 (the
  training loop checks between the RL step and that sync): the engine released its memory while
  the trainer trained and takes it back for the sync and the next generation, with the trainer's
  peak still held, so that wake would run out of memory (inside vLLM's process, without naming a
  setting);
- with sleep off the run **warns**: engine and trainer held their memory together through step 1,
  so the engine uses less than its allowance (``kv_cache_gb``); a longer rollout may still not fit.

Both name the ``gpu_memory_utilization`` that fits. The probe is a value (`MemoryProbe`), so the
decision is tested on the CPU with measured numbers injected. The agent gateway's source forwards
the check to its vLLM source; rollouts generated ahead (``train.max_staleness > 0``) do not run it:
their worker owns the ranks' exchange it gathers on (`unirl check` says so).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import ConfigError
from unirl.rollouts.serving.placement import GIB, shares_engine_gpu

logger = logging.getLogger(__name__)

# (the trainer's peak bytes on this rank's GPU, the GPU's total bytes)
MemoryProbe = Callable[[], tuple[int, int]]
# kept free beyond both, as the start-up check does (the CUDA contexts, fragmentation)
MARGIN = 0.02


def cuda_peak() -> tuple[int, int]:
    """This rank's GPU: the most torch's caching allocator reserved since the process started
    (what it still holds: no engine can use it), and the card's size."""
    device = torch.cuda.current_device()
    return torch.cuda.max_memory_reserved(device), torch.cuda.mem_get_info(device)[1]


@attrs.frozen
class FitAfterStep:
    """One GPU's verdict: ``stop`` (sleep mode: the engine's wake would not fit) or a warning,
    and the message naming the setting and the value that fits."""

    device: str
    stop: bool
    message: str


def verdict(
    peak_bytes: int, total_bytes: int, *, utilization: float, sleep: str, device: str
) -> FitAfterStep | None:
    """None when the trainer's peak and the engine's allowance fit the card with `MARGIN`."""
    engine = utilization * total_bytes
    if peak_bytes + engine <= (1.0 - MARGIN) * total_bytes:
        return None
    fits = max(0.0, (total_bytes - peak_bytes) / total_bytes - MARGIN)
    stop = sleep != "off"
    head = (
        f"after the trainer's first RL step its peak on {device} is {peak_bytes / GIB:.1f} GiB of "
        f"the card's {total_bytes / GIB:.1f} GiB, and rollout.vllm.gpu_memory_utilization="
        f"{utilization:g} gives the engine {engine / GIB:.1f} GiB: "
    )
    why = (
        f"the engine's wake (rollout.vllm.sleep={sleep!r}) for the next sync would run out of "
        "memory. "
        if stop
        else "they fit at step 1 only because the engine uses less than it may; a longer rollout "
        "may run out of memory. "
    )
    fix = (
        f"Set rollout.vllm.gpu_memory_utilization <= {fits:.2f} (and rollout.vllm.kv_cache_gb to "
        "what fits in it), reserve GPUs for generation with rollout.vllm.devices, or shrink the "
        "trainer's memory (parallel.zero_stage, micro_batch_size)"
    )
    return FitAfterStep(device=device, stop=stop, message=head + why + fix)


def verdict_here(
    options: Any, probe: MemoryProbe, *, rank: int, world_size: int
) -> FitAfterStep | None:
    """This rank's verdict (``options``: the ``rollout.vllm`` section); None where its GPU holds
    no engine or everything fits. The probe runs only where an engine shares the GPU."""
    if not shares_engine_gpu(rank, options.engines, world_size, options.tensor_parallel_size):
        return None
    peak, total = probe()
    return verdict(
        peak,
        total,
        utilization=options.gpu_memory_utilization,
        sleep=options.sleep,
        device=f"the GPU of rank {rank}",
    )


def act_on(verdicts: Sequence[FitAfterStep | None], *, rank: int) -> None:
    """Every rank's verdicts (gathered): the first that stops is a `ConfigError` on every rank;
    the warnings are logged once, by rank 0."""
    found = [v for v in verdicts if v is not None]
    stop = next((v for v in found if v.stop), None)
    if stop is not None:
        raise ConfigError(stop.message)
    if rank == 0:
        for v in found:
            logger.warning("%s", v.message)
