"""The backends the contract suite runs, and the parallel layouts each supports.

A backend joins the suite by registering a `BackendEntry`: where its builder lives
(``"package.module:function"`` called as ``build(cfg, total_optimizer_steps=..., needs_reference=...)``),
the engine package it needs, and its layouts. A layout that cannot run on the machine at hand is
skipped with a reason that says what is missing (`skip_reason`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class Layout:
    """One parallel layout: a name for test ids and tables, the process count, the config's
    ``parallel`` section (without ``world_size``, which is the process count) and any ``model``
    keys the layout sets (e.g. ``attention: padded``)."""

    name: str
    world_size: int
    parallel: tuple[tuple[str, Any], ...]
    model: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(
        cls, name: str, world_size: int, model: dict[str, Any] | None = None, **parallel: Any
    ) -> Layout:
        return cls(
            name=name,
            world_size=world_size,
            parallel=tuple(sorted(parallel.items())),
            model=tuple(sorted((model or {}).items())),
        )

    @property
    def parallel_dict(self) -> dict[str, Any]:
        return dict(self.parallel)

    @property
    def model_dict(self) -> dict[str, Any]:
        return dict(self.model)

    @property
    def dp_size(self) -> int:
        p = self.parallel_dict
        return self.world_size // (p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1))


@attrs.frozen(kw_only=True)
class BackendEntry:
    name: str
    builder: str  # "package.module:function"
    engine_package: str  # the import name of the engine it wraps
    layouts: tuple[Layout, ...]
    # Why this backend cannot run without CUDA, or None if it runs on the CPU over gloo.
    needs_cuda: str | None = None


def skip_reason(
    entry: BackendEntry, layout: Layout, device: str, devices_available: int
) -> str | None:
    """Why `layout` of `entry` cannot run here, or None."""
    if device == "cpu" and entry.needs_cuda:
        return entry.needs_cuda
    if importlib.util.find_spec(entry.engine_package) is None:
        return f"{entry.engine_package} is not installed"
    if device == "cuda" and layout.world_size > devices_available:
        return f"layout {layout.name} needs {layout.world_size} GPUs, {devices_available} available"
    return None


REGISTRY: dict[str, BackendEntry] = {}


def register_backend(entry: BackendEntry) -> BackendEntry:
    if entry.name in REGISTRY:
        raise ValueError(f"backend {entry.name!r} is already registered")
    REGISTRY[entry.name] = entry
    return entry


# ZeRO 0/1/2/3 with one and two processes: optimizer-state (1), gradient (2) and parameter (3)
# sharding each change where the step's numbers are reduced. zero 1/2 with one process shard
# nothing, so they run with two only; zero 3 runs with both (one process still partitions
# through its parameter hooks).
register_backend(
    BackendEntry(
        name="deepspeed",
        builder="unirl.backends.deepspeed:build_backend",
        engine_package="deepspeed",
        layouts=(
            Layout.of("zero0-dp1", 1, zero_stage=0),
            Layout.of("zero1-dp2", 2, zero_stage=1),
            Layout.of("zero2-dp2", 2, zero_stage=2),
            Layout.of("zero3-dp1", 1, zero_stage=3),
            Layout.of("zero3-dp2", 2, zero_stage=3),
        ),
    )
)

# Megatron on the CPU runs megatron-core's own schedules, DDP and optimizer over gloo
# (`unirl.backends.megatron.cpu_compat`). Packed sequences (the default) everywhere; the padded
# form on one process and under the interleaved schedule; context parallel (packed only).
register_backend(
    BackendEntry(
        name="megatron",
        builder="unirl.backends.megatron:build_backend",
        engine_package="megatron.core",
        layouts=(
            Layout.of("tp1-pp1-dp1", 1),
            Layout.of("padded", 1, model={"attention": "padded"}),
            Layout.of("dp2", 2),
            Layout.of("tp2", 2, tp=2),
            Layout.of("pp2", 2, pp=2),
            Layout.of("pp2-vpp2", 2, pp=2, vpp=2),  # one layer per virtual stage
            Layout.of("padded-pp2-vpp2", 2, model={"attention": "padded"}, pp=2, vpp=2),
            Layout.of("cp2", 2, cp=2),
            Layout.of("zero1-dp2", 2, zero_stage=1),
            Layout.of("tp2-pp2", 4, tp=2, pp=2),
        ),
    )
)
