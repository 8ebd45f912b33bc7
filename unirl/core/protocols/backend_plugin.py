"""How a training engine plugs in: one `BackendPlugin` registered under the name a config picks.

A backend package registers a plug-in that says everything core and the tools need to know about
it, so adding a backend edits no file under ``unirl/core``:

- ``options``: the attrs class of its own config section (the YAML key is the backend's name,
  e.g. ``megatron: {attention: padded}``); defaults live on that class;
- ``check``: its rules over the whole config (e.g. DeepSpeed has no tensor parallel), run once
  when the config is built, raising `ConfigError`;
- ``build``: its constructor, ``build(cfg, total_optimizer_steps=..., needs_reference=...)``;
  it imports the engine lazily (`LazyBuilder`), so registering needs no engine installed;
- ``requires`` / ``install_hint``: the engine packages it imports, and how to install them;
- ``layouts`` / ``needs_cuda``: the parallel layouts the contract suite runs it on;
- ``supports_critic``: whether it builds PPO's value model (``critic:``) beside the policy; the
  critic's contract then runs on its layouts marked ``critic`` (on its first dense layout if it
  marks none: a critic-capable backend never gets no critic case);
- ``supports_routing_replay``: whether its forwards record and replay MoE routing
  (``algorithm.routing_replay``, `unirl.core.config.routing_replay`);
  ``supports_sequence_parallel`` and ``supports_loss_in_head`` likewise for those features;
- ``supports_lora``: whether it trains a ``model.lora`` adapter (its backends implement
  `unirl.core.backend.TrainsAdapter`); the LoRA contract then runs on its layouts marked ``lora``.
- ``optimizer_offload``: how it keeps the optimizer state in host memory (``optimizer.offload``)
  and the bytes per parameter it keeps on a GPU with and without, for `unirl check`'s plan.

Built-in plug-ins are registered by `unirl.backends` (imported by ``import unirl``); a plug-in
outside the package registers itself with ``BACKENDS.register(plugin.name, plugin)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from unirl.core.errors import ConfigError

# ``cfg`` is the run config by its typed view: the config reads this registry while it is built
# (the backend's options class, its rules, whether it has a critic), so `UnirlConfig` is not
# imported here (`unirl.core.protocols.config_view`).
from unirl.core.protocols.config_view import RunConfigView
from unirl.core.registry import Registry

if TYPE_CHECKING:
    from unirl.core.backend import TrainingBackend


class BackendBuilder(Protocol):
    """A backend's constructor: every backend is built with exactly these arguments."""

    def __call__(
        self, cfg: RunConfigView, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> TrainingBackend: ...


@attrs.frozen
class LazyBuilder:
    """A `BackendBuilder` that imports the backend class ``"package.module:Class"`` only when a
    backend is built, so registering a plug-in imports no engine."""

    target: str

    def __call__(
        self, cfg: RunConfigView, *, total_optimizer_steps: int, needs_reference: bool = False
    ) -> TrainingBackend:
        module_name, _, name = self.target.partition(":")
        backend_class = getattr(importlib.import_module(module_name), name)
        return backend_class(
            cfg, total_optimizer_steps=total_optimizer_steps, needs_reference=needs_reference
        )


@attrs.frozen(kw_only=True)
class ContractLayout:
    """One parallel layout the contract suite runs a backend on: a name for test ids and tables,
    the process count, the config's ``parallel`` section (without ``world_size``, which is the
    process count), keys of the backend's own section (e.g. ``attention: padded``) and keys of the
    ``model`` section (e.g. ``fused_head: true``), and which of the suite's fixture models it
    runs: ``dense`` (a tiny Llama) or ``moe`` (a tiny Qwen3-MoE: expert-parallel layouts need
    experts to split). ``critic``: the CPU suite (CI) also runs PPO's critic contract on it (a
    backend with ``supports_critic``; a few layouts keep CI's added time small, the GPU runners
    run every layout). ``lora``: likewise the LoRA contract (a backend with ``supports_lora``; on
    the ``moe`` fixture with expert adapters, each expert's gate, up and down its own)."""

    name: str
    world_size: int
    parallel: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, Any], ...] = ()
    model: tuple[tuple[str, Any], ...] = ()
    fixture: str = attrs.field(default="dense", validator=attrs.validators.in_(("dense", "moe")))
    critic: bool = False
    lora: bool = False

    @classmethod
    def of(
        cls,
        name: str,
        world_size: int,
        options: Mapping[str, Any] | None = None,
        model: Mapping[str, Any] | None = None,
        fixture: str = "dense",
        critic: bool = False,
        lora: bool = False,
        **parallel: Any,
    ) -> ContractLayout:
        return cls(
            name=name,
            world_size=world_size,
            parallel=tuple(sorted(parallel.items())),
            options=tuple(sorted((options or {}).items())),
            model=tuple(sorted((model or {}).items())),
            fixture=fixture,
            critic=critic,
            lora=lora,
        )

    def with_model(self, suffix: str, **model: Any) -> ContractLayout:
        """This layout with more ``model`` keys, named ``{name}-{suffix}`` (the GPU runners'
        ``--fused-head on``)."""
        merged = {**dict(self.model), **model}
        return attrs.evolve(self, name=f"{self.name}-{suffix}", model=tuple(sorted(merged.items())))

    @property
    def parallel_dict(self) -> dict[str, Any]:
        return dict(self.parallel)

    @property
    def options_dict(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def model_dict(self) -> dict[str, Any]:
        return dict(self.model)

    @property
    def dp_size(self) -> int:
        p = self.parallel_dict
        return self.world_size // (p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1))


def _always_offloads(cfg: Any) -> str | None:
    """A backend whose every layout can offload its optimizer state (``refuses``), and none of
    whose options offloads by itself (``forced``)."""
    return None


@attrs.frozen(kw_only=True)
class OptimizerOffload:
    """How a backend keeps its optimizer state in host memory (``optimizer.offload: cpu``) and
    what stays on each GPU, for the memory plan of `unirl.core.config.optimizer_offload`.

    ``gpu_bytes(cfg, offloaded)``: bytes on one GPU per parameter of the whole model (weights,
    gradients, fp32 master weights and Adam moments, divided by the config's sharding) without
    and with the offload; ``expert_gpu_bytes``: the same per routed-expert parameter, where
    expert parallelism shards them otherwise (None: as ``gpu_bytes``); ``refuses(cfg)``: why
    this config cannot offload (e.g. it needs the distributed optimizer), or None;
    ``forced(cfg)``: the backend option that keeps the state in host memory by itself (e.g.
    ``fsdp2.cpu_offload: true``), which decides ``optimizer.offload: auto``, or None."""

    how: str
    gpu_bytes: Callable[[Any, bool], float]
    expert_gpu_bytes: Callable[[Any, bool], float] | None = None
    refuses: Callable[[Any], str | None] = _always_offloads
    forced: Callable[[Any], str | None] = _always_offloads


def _no_rules(cfg: RunConfigView) -> None:
    """A backend without rules of its own."""


@attrs.frozen(kw_only=True)
class BackendPlugin:
    """Everything core, the CLI and the contract suite know about one backend (module docstring)."""

    name: str
    options: type
    build: BackendBuilder
    check: Callable[[RunConfigView], None] = _no_rules
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    layouts: tuple[ContractLayout, ...] = ()
    # Why the contract suite cannot run it without CUDA, or None if it runs on the CPU over gloo.
    needs_cuda: str | None = None
    # Whether its backends build a critic (`TrainingBackend.critic`) when the config enables one;
    # a config that enables a critic on a backend without is refused at load.
    supports_critic: bool = False
    # Whether its forwards replay the experts of `TrainMicrobatch.routed_experts` and, in the
    # old-log-prob forward under ``routing_replay: record``, return the experts they chose; a
    # config that enables routing replay on a backend without is refused at load.
    supports_routing_replay: bool = False
    # Whether it runs ``parallel.sequence_parallel``; a config that sets it on another is refused.
    supports_sequence_parallel: bool = False
    # Whether its training forward with ``model.fused_head`` computes a separable loss inside the
    # head when the log-prob spec says ``loss_in_head`` (`unirl.core.backend.token_loss_from_hidden`);
    # on a backend without, the RL step asks for the log-probs and the loss after them.
    supports_loss_in_head: bool = False
    # Whether it trains a ``model.lora`` adapter (`unirl.core.backend.TrainsAdapter`); a config
    # with model.lora on a backend without is refused at load.
    supports_lora: bool = False
    # How it offloads the policy's optimizer state (``optimizer.offload``); None: it cannot
    # (``cpu`` is refused at load, ``auto`` keeps the state on the GPU).
    optimizer_offload: OptimizerOffload | None = None


BACKENDS: Registry[BackendPlugin] = Registry("backend", key="backend")


def build_backend(
    cfg: RunConfigView, *, total_optimizer_steps: int, needs_reference: bool = False
) -> TrainingBackend:
    """Build the backend ``cfg.backend`` names; a missing engine package is a `ConfigError` that
    says how to install it."""
    plugin = BACKENDS.get(cfg.backend)
    try:
        return plugin.build(
            cfg, total_optimizer_steps=total_optimizer_steps, needs_reference=needs_reference
        )
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in {
            r.split(".")[0] for r in plugin.requires
        }:
            raise
        hint = f"; {plugin.install_hint}" if plugin.install_hint else ""
        raise ConfigError(
            f"backend: {plugin.name} needs packages that are not installed ({exc}){hint}"
        ) from exc
