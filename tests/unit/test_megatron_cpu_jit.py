"""`unirl.backends.megatron.compat.cpu_jit`: on a CPU-only process megatron-core's jit module is
executed as written and then its own ``disable_jit_fuser()`` runs, before any importer binds
``jit_fuser``. Checked on a stand-in package written here (importing megatron-core would cost the
seconds this saves), and against the source lines of the installed megatron-core it relies on."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from unirl.backends.megatron.compat import cpu_jit

JIT_SOURCE = """
import torch
jit_fuser = torch.compile
def noop_decorator(func):
    return func
def disable_jit_fuser():
    global jit_fuser
    jit_fuser = noop_decorator
"""
USER_SOURCE = """
from fakemcore.jit import jit_fuser
@jit_fuser
def fused(x):
    return x * 2
"""


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    root = tmp_path / "fakemcore"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "jit.py").write_text(textwrap.dedent(JIT_SOURCE))
    (root / "user.py").write_text(textwrap.dedent(USER_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fakemcore"
    for name in [m for m in sys.modules if m.split(".")[0] == "fakemcore"]:
        del sys.modules[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the finder acts on CPU-only processes")
def test_jit_module_is_disabled_before_its_importers_bind_it(fake_package, monkeypatch):
    finder = cpu_jit.JitFinder(f"{fake_package}.jit")
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    user = importlib.import_module(f"{fake_package}.user")
    jit = sys.modules[f"{fake_package}.jit"]
    assert jit.jit_fuser is jit.noop_decorator
    assert type(user.fused).__name__ == "function"  # not a torch.compile wrapper
    assert user.fused(torch.tensor(3.0)).item() == 6.0
    assert finder not in sys.meta_path  # acted once, then removed itself
    assert jit.__file__.endswith("jit.py")


def test_finder_ignores_other_modules(fake_package, monkeypatch):
    finder = cpu_jit.JitFinder(f"{fake_package}.jit")
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert finder.find_spec(f"{fake_package}.user", None) is None
    assert finder in sys.meta_path


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
def test_installed_megatron_core_has_the_module_and_function_it_relies_on():
    spec = importlib.util.find_spec("megatron")
    root = Path(next(iter(spec.submodule_search_locations))) / "core"
    source = (root / "jit.py").read_text()
    assert "jit_fuser = torch.compile" in source
    assert "def disable_jit_fuser():" in source
    fusion = (root / "fusions" / "fused_bias_swiglu.py").read_text()
    assert "from megatron.core.jit import jit_fuser" in fusion
