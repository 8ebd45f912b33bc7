"""`unirl.backends.deepspeed.engine.import_muon_uncompiled`: DeepSpeed's ZeRO optimizer check
imports its Muon module, whose ``torch.compile`` decorations import TorchInductor; imported
through this function the module's kernels are plain functions and DeepSpeed's ``compile`` is
restored afterwards."""

from __future__ import annotations

import importlib.util
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed"
)


def test_muon_module_is_imported_with_its_kernels_uncompiled(monkeypatch):
    from deepspeed.runtime import compiler

    from unirl.backends.deepspeed import engine

    for name in [m for m in sys.modules if m.startswith("deepspeed.runtime.zero.muon")]:
        monkeypatch.delitem(sys.modules, name)
    original = compiler.compile
    engine.import_muon_uncompiled()
    assert compiler.compile is original
    assert engine.MUON_MODULE in sys.modules
    kernels = sys.modules["deepspeed.runtime.zero.muon.original_muon"]
    assert type(kernels.zeropower_via_newtonschulz5).__name__ == "function"
    engine.import_muon_uncompiled()  # already imported: nothing to do
    assert compiler.compile is original
