"""megatron-core without Transformer Engine: the module names megatron-core 0.16.1 binds only
inside its ``import transformer_engine`` block and still reads when that import failed.

``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` in its TE ``try`` block and its
``except ImportError`` sets only ``HAVE_TE = False``; the MoE router's gating matmul
(``RouterGatingLinearFunction``) then tests ``te_general_gemm is not None`` and raises
``NameError`` on every machine without TE, the CPU and unirl's GPU machine alike. Binding the name
to ``None`` selects megatron's own ``torch.mm`` branch, the code path the check was written for.

Same pattern as `cpu_compat`: each patch names the module attribute and the lines that read it,
checked against `CHECKED_VERSIONS`; `install()` refuses another megatron-core version, since it
may have moved the reads or bound the name itself. Unlike `cpu_compat` it applies wherever TE is
absent (``moe_utils.HAVE_TE`` is false), on CPUs and GPUs, and does nothing where TE imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Any

import attrs


def te_available() -> bool:
    """Whether Transformer Engine is installed (megatron-core then takes its fused paths)."""
    return importlib.util.find_spec("transformer_engine") is not None


logger = logging.getLogger(__name__)

# The megatron-core versions whose source the lines below were read from and run against.
CHECKED_VERSIONS = ("0.16.1",)


@attrs.frozen(kw_only=True)
class UnboundNamePatch:
    """A module global that megatron-core reads but binds only when TE imports, and the value it
    gets without TE (the value its readers test for)."""

    module: str
    name: str
    value: Any
    lines: tuple[str, ...]  # "file:line" under megatron/core that read the name


PATCHES: tuple[UnboundNamePatch, ...] = (
    UnboundNamePatch(
        module="megatron.core.transformer.moe.moe_utils",
        name="te_general_gemm",
        value=None,
        lines=(
            # RouterGatingLinearFunction.forward / .backward:
            # if te_general_gemm is not None and router_dtype != torch.float64:
            "transformer/moe/moe_utils.py:1192",
            "transformer/moe/moe_utils.py:1225",
        ),
    ),
)

_installed = False


def listed_lines() -> set[str]:
    """Every ``"file.py:line"`` of `PATCHES`."""
    return {line for patch in PATCHES for line in patch.lines}


def install() -> None:
    """Bind every name of `PATCHES` where megatron-core runs without TE (idempotent; a no-op
    where TE imported). Call before building a model: on a GPU as on the CPU."""
    global _installed
    if _installed:
        return
    from megatron.core import package_info

    version = package_info.__version__
    applied = []
    for patch in PATCHES:
        module = importlib.import_module(patch.module)
        if module.HAVE_TE:
            continue  # TE imported, so megatron-core bound the name itself
        if version not in CHECKED_VERSIONS:
            raise RuntimeError(
                f"unirl's patch for megatron-core without Transformer Engine "
                f"({patch.module}.{patch.name}) was checked against "
                f"{', '.join(CHECKED_VERSIONS)}, found megatron-core {version}: install "
                f"megatron-core=={CHECKED_VERSIONS[-1]} or Transformer Engine, or re-check the "
                "lines listed in unirl/backends/megatron/compat/te.py against the new version"
            )
        if patch.name in vars(module):  # bound before (by hand): to the same value only
            assert getattr(module, patch.name) is patch.value, (patch.module, patch.name)
            continue
        setattr(module, patch.name, patch.value)
        applied.append(f"{patch.module}.{patch.name}")
    _installed = True
    if applied:
        logger.info(
            "megatron-core %s without Transformer Engine: bound %s (unirl.backends.megatron."
            "te_compat)",
            version,
            ", ".join(applied),
        )
