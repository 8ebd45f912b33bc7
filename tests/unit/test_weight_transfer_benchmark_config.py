"""The 7B sync-memory benchmark builds its trainer config on the CPU: the GPU call is too dear to
find a config error in (an fsdp2 run once died there on a missing namespace field)."""

from __future__ import annotations

import pytest

from benchmarks.weight_transfer import _backend_config
from unirl.core.config.run_config import config_from_dict


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_memory_benchmark_config_is_valid(backend: str, tmp_path) -> None:
    cfg = config_from_dict(_backend_config(backend, str(tmp_path), weights=str(tmp_path / "w")))
    assert cfg.backend == backend
    assert cfg.model.path == str(tmp_path / "w")
    assert cfg.logging.run_dir == str(tmp_path)
