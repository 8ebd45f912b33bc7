"""Training engines, as plug-ins. Each subpackage implements `unirl.core.backend.TrainingBackend`
and registers a `unirl.core.protocols.backend_plugin.BackendPlugin` from its light ``plugin`` module (no
engine import), so `import unirl` needs no engine installed and the engine is imported only when
a config's ``backend:`` names it. ``README.md`` here says what a backend folder holds.

The modules beside the backend folders are shared by every backend (the passes' argument checks,
device moves, forward-only mode, process groups, the watchdog, the Hugging Face model build);
`hf/` is shared by the Hugging Face engines (DeepSpeed, FSDP2). No backend folder imports another."""

from __future__ import annotations

from unirl.backends.deepspeed.plugin import PLUGIN as _DEEPSPEED
from unirl.backends.fsdp2.plugin import PLUGIN as _FSDP2
from unirl.backends.megatron.plugin import PLUGIN as _MEGATRON
from unirl.core.protocols.backend_plugin import BACKENDS, build_backend

for _plugin in (_DEEPSPEED, _MEGATRON, _FSDP2):
    BACKENDS.register(_plugin.name, _plugin)

__all__ = ["BACKENDS", "build_backend"]
