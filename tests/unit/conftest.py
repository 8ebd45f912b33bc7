"""Fixtures the unit tests share: one thread for a module of tiny matmuls, and the tiny Llama
folder of the Hugging Face backends' tests (`tests.hf_reference`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from threads, and on a shared CPU they wait on each other: a
    module that asks (``pytestmark = pytest.mark.usefixtures("one_thread")``) runs on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tests.hf_reference.save_tiny_model`'s folder (the reference weights), once per module."""
    from tests.hf_reference import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"))
