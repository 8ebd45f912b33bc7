"""unirl: the training core of LLM RL post-training, one implementation for every engine.

`import unirl` needs neither Megatron-core, DeepSpeed, vLLM nor torch; backends and rollout
sources register as plug-ins (`unirl.core.protocols.backend_plugin`, `unirl.core.protocols.source_plugin`) and their
engines are imported only when a config names them.
"""

# Registers the built-in backend and rollout-source plug-ins (their light `plugin` modules; no
# engine is imported).
from unirl import backends as _backends  # noqa: F401  (after the errors it imports)
from unirl import rollouts as _rollouts  # noqa: F401
from unirl.core.errors import ConfigError, LossInputError, RolloutDataError, UnirlError

__version__ = "0.1.0"

__all__ = ["ConfigError", "LossInputError", "RolloutDataError", "UnirlError", "__version__"]
