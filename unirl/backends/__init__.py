"""Training engines, as plug-ins. Each subpackage implements `unirl.core.backend.TrainingBackend`
and registers a `unirl.core.backend_plugin.BackendPlugin` from its light ``plugin`` module (no
engine import), so `import unirl` needs no engine installed and the engine is imported only when
a config's ``backend:`` names it. Plumbing the backends share (process group, device moves,
forward-only passes, the empty-microbatch loss) lives once beside them: `distributed`, `plumbing`.
"""

from __future__ import annotations

from unirl.backends.deepspeed.plugin import PLUGIN as _DEEPSPEED
from unirl.backends.megatron.plugin import PLUGIN as _MEGATRON
from unirl.core.backend_plugin import BACKENDS, build_backend

for _plugin in (_DEEPSPEED, _MEGATRON):
    BACKENDS.register(_plugin.name, _plugin)

__all__ = ["BACKENDS", "build_backend"]
