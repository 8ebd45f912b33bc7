"""Megatron-core backend (TP, PP, VPP, CP, EP; DP with DDP and the distributed optimizer). Imported
only when `backend: megatron` is chosen, so `import unirl` needs neither megatron-core nor
transformers; ``plugin`` (its config section and rules) imports no engine.

The root holds the backend template (plugin, topology, model, role model, critic, checkpoint,
optimizer, backend) and the loop (packed / padded microbatches, one schedule call, the heads, the
passes); the rooms below hold the rest by kind: ``kernels`` (GPU fusions and attention),
``moe`` (expert layers, dispatch, router stages, routing replay), ``compat`` (megatron-core
without CUDA or Transformer Engine) and ``weights`` (Hugging Face weights in and out).
`compat.cpu_jit` is installed here, before any module of the package imports megatron-core."""

from __future__ import annotations

from unirl.backends.megatron.compat import cpu_jit
from unirl.backends.megatron.plugin import PLUGIN

cpu_jit.install()

build_backend = PLUGIN.build

__all__ = ["build_backend"]
