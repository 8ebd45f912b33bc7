"""DeepSpeed backend (ZeRO 0-3) on Hugging Face causal LMs. Imported only when `backend: deepspeed`
is chosen, so `import unirl` needs neither DeepSpeed nor transformers.

Files: `plugin` (config section, rules, constructor; imports no engine), `distributed` (DeepSpeed's
communication and op-build lock), `topology`, `engine` (DeepSpeed config, engine initialisation,
optimizer step, reference engine), `model` (`DeepSpeedModel`, the policy and the critic;
`DeepSpeedReference`), `backend` (`DeepSpeedBackend` on `unirl.backends.hf.backend.HFBackend`),
`checkpoint` (the engines' own files), `export` (ZeRO-3 gathering).
"""

from __future__ import annotations

from unirl.backends.deepspeed.plugin import PLUGIN

build_backend = PLUGIN.build

__all__ = ["build_backend"]
