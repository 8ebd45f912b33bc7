"""Training engines. Each subpackage implements `unirl.core.backend.TrainingBackend`; they are
imported only when a config names them, so `import unirl` needs neither engine installed."""

from __future__ import annotations

import importlib
from typing import Any

from unirl.core.backend import TrainingBackend
from unirl.core.errors import ConfigError
from unirl.core.run.config import UnirlConfig

_INSTALL_HINT = {
    "deepspeed": "pip install 'unirl[deepspeed,hf]'",
    "megatron": "pip install 'unirl[megatron,hf]'",
}


def build_backend(cfg: UnirlConfig, **kwargs: Any) -> TrainingBackend:
    """Import `unirl.backends.<cfg.backend>` and build its backend for this config."""
    name = cfg.backend
    try:
        module = importlib.import_module(f"unirl.backends.{name}")
        builder = module.build_backend
    except ImportError as exc:
        raise ConfigError(
            f"backend: {name} needs packages that are not installed ({exc}); {_INSTALL_HINT[name]}"
        ) from exc
    except AttributeError:
        raise ConfigError(f"backend: {name} is not available in this version of unirl") from None
    return builder(cfg, **kwargs)
