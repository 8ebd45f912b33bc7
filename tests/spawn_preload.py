"""What the forkserver of `tests.spawn.run_distributed` imports once, before it forks any rank:
the heavy third-party packages every rank imports (torch, transformers, DeepSpeed, megatron-core:
5-8 CPU seconds in each fresh interpreter on the CI machine, so a two-rank group spent 10-16 CPU
seconds importing). A forked rank finds them loaded.

Only packages that read nothing a test changes between ranks are here (a test's environment
reaches each rank anyway: `tests.spawn` sets it before the rank's function runs, and modules
such as unirl's Triton kernels, which read ``TRITON_INTERPRET`` when they are imported, are
imported by the rank itself). ``unirl.backends.megatron`` comes first: its ``__init__`` installs
the CPU jit-fuser switch, which must precede megatron-core's import (`cpu_jit`). A package that is
not installed, or fails to import, is left to the rank, which reports it as before.
"""

from __future__ import annotations

import contextlib
import importlib

PRELOAD = (
    "torch",
    "torch.distributed",
    "unirl.backends.megatron",
    "transformers",
    "deepspeed",
    "megatron.core",
)

for _name in PRELOAD:
    with contextlib.suppress(Exception):  # the rank imports it again and reports the error
        importlib.import_module(_name)
