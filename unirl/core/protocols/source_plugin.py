"""How a rollout source plugs in: one `SourcePlugin` registered under the name ``rollout.source``
picks, as backends do (`unirl.core.protocols.backend_plugin`), so adding a source edits no file under
``unirl/core``:

- ``options``: the attrs class of its own section inside ``rollout`` (the key is the source's
  name, e.g. ``rollout: {vllm: {kv_cache_gb: 1}}``), or None for a source without options; the
  built instance is ``cfg.rollout.source_options``;
- ``check``: its rules over the whole config (e.g. vLLM's ``max_model_len`` fits
  ``model.max_seq_len``), run once when the config is built, raising `ConfigError`;
- ``describe``: what ``unirl check`` prints about it under ``# rollouts`` (a flat mapping);
- ``build``: its constructor, ``build(cfg, hf_model=..., device=...)`` returning a
  `unirl.rollouts.source.RolloutSource`; it imports the source's code lazily (`LazySourceBuilder`);
- ``generates``: whether it generates from prompts (``rollout.task`` or ``rollout.prompts``):
  a generation bar, the task's tokenizer saved with the export; False for finished rollouts (a
  file);
- ``requires`` / ``install_hint``: the packages it imports, and how to install them;
- ``loggers`` / ``log_level_env``: its engine's logger names and the environment variable the
  engine's own processes read their log level from; `unirl.log_setup` quiets both below DEBUG;
- ``weights``: who receives the policy's weights after every step (`unirl.core.weights.stream`):
  ``"rank0"`` (an engine driven from global rank 0), ``"every_rank"`` (a sampler on every rank),
  or ``"none"`` (a rollout file: the run streams nothing and pays nothing for it); or a function
  of the config giving one of those (`weight_receivers`: vLLM with several engines needs every
  rank);
- ``top_p_logprobs``: which distribution its rollout log-probs describe under ``rollout.top_p < 1``
  (what ``unirl check`` says the mismatch metrics measure, `unirl.core.mismatch`).

The built-in sources (``sampler``, ``file``, ``vllm``) are registered by `unirl.rollouts`
(imported by ``import unirl``); a plug-in outside the package registers itself with
``SOURCES.register(plugin.name, plugin)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

import attrs

from unirl.core.errors import ConfigError

# ``cfg`` is the run config by its typed view: the config reads this registry while it is built
# (the source's options class, its rules), so `UnirlConfig` is not imported here
# (`unirl.core.protocols.config_view`).
from unirl.core.protocols.config_view import RunConfigView
from unirl.core.registry import Registry

WeightReceivers = Literal["rank0", "every_rank", "none"]


class SourceBuilder(Protocol):
    """A source's constructor. ``hf_model`` (the policy in Hugging Face form) and ``device`` are
    what an in-process generator may start from; a source that does not need them ignores them.
    Returns a `unirl.rollouts.source.RolloutSource` (core does not name that type)."""

    def __call__(self, cfg: RunConfigView, *, hf_model: Any = None, device: Any = None) -> Any: ...


@attrs.frozen
class LazySourceBuilder:
    """A `SourceBuilder` that imports the function ``"package.module:function"`` only when a
    source is built, so registering a plug-in imports neither torch nor an engine."""

    target: str

    def __call__(self, cfg: RunConfigView, *, hf_model: Any = None, device: Any = None) -> Any:
        module_name, _, name = self.target.partition(":")
        build = getattr(importlib.import_module(module_name), name)
        return build(cfg, hf_model=hf_model, device=device)


def _no_rules(cfg: RunConfigView) -> None:
    """A source without rules of its own."""


def _no_description(cfg: RunConfigView) -> Mapping[str, Any]:
    return {}


@attrs.frozen(kw_only=True)
class SourcePlugin:
    """Everything core, the CLI and the logging set-up know about one rollout source (module
    docstring)."""

    name: str
    build: SourceBuilder
    options: type | None = None
    check: Callable[[RunConfigView], None] = _no_rules
    describe: Callable[[RunConfigView], Mapping[str, Any]] = _no_description
    generates: bool = True
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    loggers: tuple[str, ...] = ()
    log_level_env: str | None = None
    weights: WeightReceivers | Callable[[RunConfigView], WeightReceivers] = "rank0"
    # Under rollout.top_p < 1: "truncated", the renormalised distribution it sampled from (a
    # serving engine); "untruncated", the full softmax (the built-in sampler); None: not known.
    top_p_logprobs: Literal["truncated", "untruncated"] | None = None
    # Whether it runs multi-turn episodes against rollout.environment (unirl/rollouts/environments/episodes.py).
    runs_episodes: bool = False


SOURCES: Registry[SourcePlugin] = Registry("rollout source", key="rollout.source")


def weight_receivers(cfg: RunConfigView) -> WeightReceivers:
    """Who receives the weights of ``cfg``'s rollout source (``SourcePlugin.weights``)."""
    weights = SOURCES.get(cfg.rollout.source).weights
    return weights(cfg) if callable(weights) else weights


def build_source(cfg: RunConfigView, *, hf_model: Any = None, device: Any = None) -> Any:
    """Build the source ``cfg.rollout.source`` names; a missing package it requires is a
    `ConfigError` that says how to install it."""
    plugin = SOURCES.get(cfg.rollout.source)
    try:
        return plugin.build(cfg, hf_model=hf_model, device=device)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in {
            r.split(".")[0] for r in plugin.requires
        }:
            raise
        hint = f"; {plugin.install_hint}" if plugin.install_hint else ""
        raise ConfigError(
            f"rollout.source: {plugin.name} needs packages that are not installed ({exc}){hint}"
        ) from exc
