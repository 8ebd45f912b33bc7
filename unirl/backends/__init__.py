"""Training engines, as plug-ins. Each subpackage implements `unirl.core.backend.TrainingBackend`
and registers a `unirl.core.backend_plugin.BackendPlugin` from its light ``plugin`` module (no
engine import), so `import unirl` needs no engine installed and the engine is imported only when
a config's ``backend:`` names it. ``README.md`` here says what a backend folder holds.

Shared by every backend, beside them: `base` (argument checks and forward counters of the passes),
`microbatch` (device moves, the empty-microbatch zero), `forward_only` (eval mode, no autograd,
an offloaded model moved in), `process_group`, `watchdog`, `hf_model` (Hugging Face model
build). Shared by the Hugging Face engines (DeepSpeed, FSDP2): `hf` (the microbatch loop, the
backend that holds policy, reference and critic, packed attention, fused head, optimizer, export,
checkpoint staging).
"""

from __future__ import annotations

from unirl.backends.deepspeed.plugin import PLUGIN as _DEEPSPEED
from unirl.backends.fsdp2.plugin import PLUGIN as _FSDP2
from unirl.backends.megatron.plugin import PLUGIN as _MEGATRON
from unirl.core.backend_plugin import BACKENDS, build_backend

for _plugin in (_DEEPSPEED, _MEGATRON, _FSDP2):
    BACKENDS.register(_plugin.name, _plugin)

__all__ = ["BACKENDS", "build_backend"]
