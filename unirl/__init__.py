"""unirl: the training core of LLM RL post-training, one implementation for every engine.

`import unirl` needs neither Megatron-core nor DeepSpeed; backends are imported lazily when a
config names them.
"""

from unirl.core.errors import ConfigError, LossInputError, RolloutDataError, UnirlError

__version__ = "0.1.0"

__all__ = ["ConfigError", "LossInputError", "RolloutDataError", "UnirlError", "__version__"]
