"""What every benchmark JSON records about the run that made it: the exact command, the date, the
Python / torch / package versions and the GPUs (one helper for all the GPU benchmark scripts)."""

from __future__ import annotations

import datetime
import importlib.metadata
import platform
import sys
from collections.abc import Iterable
from typing import Any

import torch


def run_environment(packages: Iterable[str] = ("transformers", "megatron-core")) -> dict[str, Any]:
    """The command (as run from the repo root), date, versions of Python, torch and
    ``packages`` (None where not installed) and the visible GPUs' names."""
    env: dict[str, Any] = {
        "command": "PYTHONPATH=$PWD python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    for name in packages:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    return env
