"""The backends the contract suite runs, and the parallel layouts each supports, read from the
backend registry: a backend joins the suite by declaring ``layouts`` in its `BackendPlugin`
(`unirl.core.protocols.backend_plugin`). A layout that cannot run on the machine at hand is skipped with a
reason that says what is missing (`skip_reason`).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import attrs

from unirl.backends import BACKENDS
from unirl.core.protocols.backend_plugin import BackendPlugin, ContractLayout

Layout = ContractLayout
BackendEntry = BackendPlugin

# The registered backends that declare contract layouts, by name.
REGISTRY: dict[str, BackendPlugin] = {p.name: p for p in BACKENDS.values() if p.layouts}


def skip_reason(
    entry: BackendPlugin, layout: ContractLayout, device: str, devices_available: int
) -> str | None:
    """Why `layout` of `entry` cannot run here, or None."""
    if device == "cpu" and entry.needs_cuda:
        return entry.needs_cuda
    for package in entry.requires:
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed"
    if device == "cuda" and layout.world_size > devices_available:
        return f"layout {layout.name} needs {layout.world_size} GPUs, {devices_available} available"
    return None


def critic_layouts(entry: BackendPlugin) -> tuple[ContractLayout, ...]:
    """The layouts the CPU suite runs PPO's critic contract on, from the plug-in's declared
    capability: none without ``supports_critic``; else the dense layouts it marks ``critic``, or
    its first dense layout when it marks none (a new critic-capable backend gets a case without
    an edit here). The first is the baseline of the critic's layout comparison."""
    if not entry.supports_critic:
        return ()
    dense = [layout for layout in entry.layouts if layout.fixture == "dense"]
    return tuple(layout for layout in dense if layout.critic) or tuple(dense[:1])


def lora_layouts(entry: BackendPlugin) -> tuple[ContractLayout, ...]:
    """The layouts the CPU suite runs the LoRA contract on (`tests.contract.lora`), as
    `critic_layouts` picks the critic's: none without ``supports_lora``; else the dense layouts
    it marks ``lora``, or its first dense layout when it marks none; then the MoE layouts it
    marks ``lora`` (expert adapters in the per-expert, per-projection form; none by default)."""
    if not entry.supports_lora:
        return ()
    dense = [layout for layout in entry.layouts if layout.fixture == "dense"]
    moe = [layout for layout in entry.layouts if layout.fixture == "moe" and layout.lora]
    return (tuple(layout for layout in dense if layout.lora) or tuple(dense[:1])) + tuple(moe)


FusedHeadMode = Literal["declared", "on", "off"]
FUSED_HEAD_MODES = ("declared", "on", "off")


def with_fused_head(layout: ContractLayout, mode: FusedHeadMode) -> ContractLayout | None:
    """`layout` under a GPU runner's ``--fused-head``: "declared" as the plug-in declares it;
    "on" / "off" set ``model.fused_head`` on every layout, names unchanged (under "off" a layout
    declared with the fused head is left out: it would repeat its plain twin)."""
    if mode == "declared":
        return layout
    declared = bool(layout.model_dict.get("fused_head", False))
    if mode == "off" and declared:
        return None
    model = {**layout.model_dict, "fused_head": mode == "on"}
    return attrs.evolve(layout, model=tuple(sorted(model.items())))
