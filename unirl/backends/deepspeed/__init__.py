"""DeepSpeed backend (ZeRO 0-3) on Hugging Face causal LMs. Imported only when `backend: deepspeed`
is chosen, so `import unirl` needs neither DeepSpeed nor transformers.

Files: `distributed` (process group, op-build lock), `model` (HF load / seeded init), `packed`
(packed microbatches through varlen attention), `engine` (DeepSpeed config, optimizer, LR
schedule, reference engine), `topology`, `backend` (`DeepSpeedBackend`), `checkpoint`, `export`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unirl.backends.deepspeed.backend import DeepSpeedBackend
    from unirl.core.run.config import UnirlConfig


def build_backend(cfg: UnirlConfig, **kwargs: Any) -> DeepSpeedBackend:
    """`DeepSpeedBackend(cfg, total_optimizer_steps=..., needs_reference=...)`."""
    from unirl.backends.deepspeed.backend import DeepSpeedBackend

    return DeepSpeedBackend(cfg, **kwargs)


__all__ = ["build_backend"]
