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

# Layouts in the slow tier (tests/conftest.py) of the contract, and of the LoRA contract on them
# (so that in CI a LoRA job always runs in its contract group's processes): variants whose parts
# each have a layout in the default tier (tp2-sp, fused, tp2 and pp2, zero1-dp2, padded and
# pp2-vpp2, zero1/zero3 run
# there; ZeRO-3 at dp1: zero3-dp2 and zero3-dp1-fused; for MoE, moe-ep2, moe-tp2-ep2-sp and
# moe-pp2 on 2 ranks), the fused head at TP = 2 also in tests/distributed/test_megatron_model.py
# (test_fused_head_tp2_matches_hf_fp64, every rank's log-probs, entropy and gradients against
# HF fp64) and tests/distributed/test_head_loss_tp.py; each passed here once.
# The two 4-rank MoE layouts (expert TP 2; PP 2 x EP 2) cost 4 processes' start-up (megatron's
# imports: most of their build section) on 2 cores: 27 s and 32 s at load ~3, 210 s and 320 s
# under other jobs' load; their 2-rank twins moe-tp2-ep2-sp and moe-pp2 took 10.5 s and 13.2 s.
SLOW_LAYOUTS = {
    "megatron": (
        "padded-tp2-sp", "fused-tp2", "fused-tp2-sp", "fused-pp2-vpp2", "tp2-pp2", "dp2",
        "padded-pp2-vpp2", "moe-ep2-etp2", "moe-pp2-ep2",
    ),
    "deepspeed": ("zero2-dp2", "zero3-dp1"),
}  # fmt: skip


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
