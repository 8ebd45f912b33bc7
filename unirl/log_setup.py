"""What reaches the terminal: unirl's log lines at ``logging.level``, never inside a progress bar,
and the engines' own chatter only when ``logging.level: DEBUG`` asks for it.

- `install_handler` (the CLI calls it once, at start; it does what ``logging.basicConfig`` does
  and nothing when the program already configured logging) writes every record through
  ``tqdm.write``: a bar drawn on the same stream is lifted, the line written on its own line and
  the bar redrawn beneath it. A plain stream handler would write into the middle of the bar.
- `apply_log_level` (``unirl train`` and ``unirl check`` call it with ``cfg.logging.level``) sets
  the ``unirl`` logger's level and the engines': below DEBUG, records of DeepSpeed,
  torch.distributed, Megatron, transformers, their helpers and the loggers every registered
  rollout source declares (`SourcePlugin.loggers`, e.g. vLLM's) are dropped unless they are
  errors, Hugging Face's own progress bars (e.g. "Writing model shards" of an export) are
  switched off, and a source's engine processes are told the same through the environment
  variable its plug-in names (`SourcePlugin.log_level_env`, e.g. ``VLLM_LOGGING_LEVEL``; unless
  the user set it). At DEBUG everything passes.
- The ``unirl.engines`` logger gets what engines ``print`` while a backend drives them
  (`unirl.backends.engine_output.engine_prints`, DeepSpeed's op build): DEBUG records, shown at
  DEBUG only.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

from unirl.core.protocols.source_plugin import SOURCES

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Loggers of the training engines and libraries unirl drives (their top-level names; DeepSpeed
# logs to "DeepSpeed", with its own handler); rollout sources declare their own.
ENGINE_LOGGERS = (
    "DeepSpeed",
    "deepspeed",
    "torch.distributed",
    "megatron",
    "transformers",
    "accelerate",
    "huggingface_hub",
    "safetensors",
)
ENGINE_QUIET_LEVEL = logging.ERROR


def engine_loggers() -> tuple[str, ...]:
    """`ENGINE_LOGGERS` and the loggers of every registered rollout source."""
    declared = (name for plugin in SOURCES.values() for name in plugin.loggers)
    return tuple(dict.fromkeys((*ENGINE_LOGGERS, *declared)))


class TqdmHandler(logging.Handler):
    """Writes records to the current ``sys.stderr`` through ``tqdm.write`` (bars stay intact)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def install_handler(level: str = "INFO") -> bool:
    """Give the root logger a `TqdmHandler` at `level`, as ``logging.basicConfig`` would; does
    nothing (returns False) when the root logger already has handlers (the embedding program,
    or pytest, chose where records go)."""
    root = logging.getLogger()
    if root.handlers:
        return False
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    return True


class _Below(logging.Filter):
    """Drops records under a threshold. Set on DeepSpeed's logger as well as its level, because
    DeepSpeed sets that logger's level (and its own handler) when it is first imported."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.threshold


# The value unirl last wrote into each engine's level variable: a value that differs was set by
# the user, and is kept.
_env_set_here: dict[str, str] = {}


def apply_log_level(level: str) -> None:
    """``logging.level``: unirl's own loggers at `level`; the engines' at ERROR unless `level`
    is DEBUG (then everything passes)."""
    logging.getLogger("unirl").setLevel(level)
    debug = level == "DEBUG"
    engines = logging.DEBUG if debug else ENGINE_QUIET_LEVEL
    for name in engine_loggers():
        logger = logging.getLogger(name)
        logger.setLevel(engines)
        for old in [f for f in logger.filters if isinstance(f, _Below)]:
            logger.removeFilter(old)
        logger.addFilter(_Below(engines))
    # Engines that configure their loggers from the environment in every process they spawn.
    for env in {p.log_level_env for p in SOURCES.values() if p.log_level_env}:
        if env not in os.environ or os.environ[env] == _env_set_here.get(env):
            _env_set_here[env] = "DEBUG" if debug else logging.getLevelName(ENGINE_QUIET_LEVEL)
            os.environ[env] = _env_set_here[env]
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers is optional (the hf extra)
        return
    if debug:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
