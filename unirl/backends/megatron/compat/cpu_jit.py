"""On a CPU-only process, megatron-core's ``jit_fuser`` is its own no-op decorator instead of
``torch.compile``.

megatron-core 0.16.1 picks ``jit_fuser = torch.compile`` when ``megatron.core.jit`` is first
imported, and its fusion modules apply it at their own import (38 functions). Each decoration
imports TorchInductor (``torch._inductor.compile_fx`` and its lowering tables: about 4 s of CPU
time per process, more than the rest of megatron-core together), and each fused function that
runs (the SwiGLU of ``bias_activation_fusion``) is traced and compiled into C++ on its first
call and again for new shapes: seconds per process, for a CPU run whose models are tiny. On the
CPU the fused functions therefore run as the plain PyTorch code they are written as: megatron's
``disable_jit_fuser()``, called right after ``megatron.core.jit`` executes, before any fusion
module decorates with it (called any later, the functions would already be compiled wrappers).
Forward values are those of the compiled kernels; gradients may differ in the last bit (the
compiled backward orders its float operations its own way).

`install()` adds a finder for that one module name to ``sys.meta_path`` (the package's
``__init__`` calls it, before any file of this package imports megatron-core); it acts once,
only where ``torch.cuda.is_available()`` is false, and changes nothing on a GPU process or if
``megatron.core.jit`` is already imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

JIT_MODULE = "megatron.core.jit"


class _DisableAfterExec(importlib.abc.Loader):
    """Runs the module as its own loader would, then megatron's ``disable_jit_fuser()`` on a
    CPU-only process."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._inner.exec_module(module)
        import torch  # imported by megatron.core before its jit module

        if not torch.cuda.is_available():
            module.disable_jit_fuser()
            logger.debug("megatron-core's jit_fuser is the no-op on this CPU-only process")

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename ... for tracebacks
        return getattr(self._inner, name)


class JitFinder(importlib.abc.MetaPathFinder):
    """Finds the module `name` (``megatron.core.jit``) with the other finders and wraps its
    loader; removes itself from ``sys.meta_path`` on first use (a module executes once)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _DisableAfterExec(spec.loader)
                return spec
        return None


_FINDER = JitFinder(JIT_MODULE)


def install() -> None:
    """Make the next import of ``megatron.core.jit`` disable the jit fuser on a CPU process."""
    if JIT_MODULE in sys.modules or _FINDER in sys.meta_path:
        return
    sys.meta_path.insert(0, _FINDER)
