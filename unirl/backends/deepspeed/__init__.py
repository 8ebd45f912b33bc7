"""DeepSpeed backend (ZeRO 0-3) on Hugging Face causal LMs. Imported only when `backend: deepspeed`
is chosen, so `import unirl` needs neither DeepSpeed nor transformers.

Files: `plugin` (config section, rules, constructor; imports no engine), `distributed` (DeepSpeed's
communication and op-build lock), `packed`
(packed microbatches through varlen attention), `engine` (DeepSpeed config, optimizer, LR
schedule, reference engine), `topology`, `backend` (`DeepSpeedBackend`), `checkpoint`, `export`.
"""

from __future__ import annotations

from unirl.backends.deepspeed.plugin import PLUGIN

build_backend = PLUGIN.build

__all__ = ["build_backend"]
