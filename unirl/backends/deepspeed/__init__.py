"""DeepSpeed backend (ZeRO 0-3) on Hugging Face causal LMs, on the shared `unirl.backends.hf`
loop and backend. Imported only when `backend: deepspeed` is chosen, so `import unirl` needs
neither DeepSpeed nor transformers; ``plugin`` (its config section and rules) imports no engine."""

from __future__ import annotations

from unirl.backends.deepspeed.plugin import PLUGIN

build_backend = PLUGIN.build

__all__ = ["build_backend"]
