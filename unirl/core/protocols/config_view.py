"""The run config as the plug-in seams read it: a typed view that `UnirlConfig` satisfies.

The config is built from the plug-in registries (`unirl.core.protocols.backend_plugin`,
`unirl.core.protocols.source_plugin`): it reads each plug-in's options class and runs its rules while it is
built. So the registries sit below the config and cannot name `UnirlConfig` (an import circle,
tests/unit/test_import_cycles.py); they name this view instead, which declares exactly the keys
they and the config's own load-time rules (`unirl.core.config.routing_replay`) read. Each key is
a read-only property, so the frozen attrs sections satisfy it as they are;
tests/unit/test_config_view.py checks that `UnirlConfig` does, key by key.

A plug-in's own rules are always called with the whole `UnirlConfig`, so they may annotate it
(a backend or source package sits above core's config and imports it freely).
"""

from __future__ import annotations

from typing import Protocol


class AlgorithmView(Protocol):
    """The ``algorithm`` keys the load-time rules read."""

    @property
    def routing_replay(self) -> str: ...


class RolloutView(Protocol):
    """The ``rollout`` keys the source registry and the weight sync read."""

    @property
    def source(self) -> str: ...

    @property
    def weight_bucket_mb(self) -> int: ...


class RunConfigView(Protocol):
    """The run config's keys the plug-in seams read (module docstring)."""

    @property
    def backend(self) -> str: ...

    @property
    def old_logprobs(self) -> str: ...

    @property
    def algorithm(self) -> AlgorithmView: ...

    @property
    def rollout(self) -> RolloutView: ...
