"""Megatron-core backend (TP, PP, VPP, CP; DP with DDP and the distributed optimizer). Imported
only when `backend: megatron` is chosen, so `import unirl` needs neither megatron-core nor
transformers.

Files: `plugin` (config section, rules, constructor; imports no engine), `topology` (parallel
state -> core `Topology`), `model` (GPTModel chunks from an HF config, the core attention),
`varlen_attention` (causal attention over packed sequences, with context parallel), `convert` /
`hf_io` (HF weights in and out), `sources` (each model's initial weights), `packed` (microbatches
as THD model inputs, the default) and `padded` (as right-padded rows), `schedule` (one call of
megatron's pipeline schedule, the loss factor), `heads` (what a model's last stage computes:
log-probs or values; `fused_head`), `role_model` (`MegatronModel`: one held model, trained or
frozen), `passes` (the microbatch loop, once for every model and pass), `optimizer` (DDP,
optimizer, LR schedule), `checkpoint` (distributed checkpointing), `cpu_compat` (megatron-core's
CUDA-only lines, patched on the CPU only), `te_compat` (names megatron-core reads but only TE
binds, bound wherever TE is absent), `grouped_experts` (MoE experts on ``torch._grouped_mm``, or
megatron's `SequentialMLP`), `grouped_dispatch` (the MoE layer of grouped experts: its
all-to-all dispatcher without host syncs at ep x etp = 1), `multi_tensor` (megatron's gradient
norm without TE / Apex in foreach kernels, CUDA), `critic` (the critic as core's `CriticModel`),
`backend` (`MegatronBackend`), `cpu_jit` (megatron's jit fuser off on a CPU-only process:
installed here, before any file of the package imports megatron-core).
"""

from __future__ import annotations

from unirl.backends.megatron import cpu_jit
from unirl.backends.megatron.plugin import PLUGIN

cpu_jit.install()

build_backend = PLUGIN.build

__all__ = ["build_backend"]
