"""The sections that shape training: ``optimizer``, ``batch``, ``parallel`` and ``train``."""

from __future__ import annotations

from typing import Literal

import attrs

from unirl.core.config.validators import (
    adam_betas,
    in_range,
    non_negative,
    positive,
    unit_interval,
)

Schedule = Literal["constant", "linear", "cosine"]


@attrs.frozen(kw_only=True)
class OptimizerConfig:
    """AdamW on every backend (torch's; Megatron's wraps it in its distributed optimizer)."""

    # Above 1e30 AdamW's first step size, lr / (1 - betas[0]), nears fp32's limit and torch fails.
    lr: float = attrs.field(
        default=1e-6,
        validator=in_range(0, 1e30, low_open=True, why="typical RL values: 1e-7 to 1e-5"),
    )
    # AdamW's decoupled decay, on matrices only: norms and biases (1-D parameters) are not
    # decayed, as in Megatron-core and the Hugging Face Trainer (every backend does the same).
    weight_decay: float = attrs.field(default=0.0, validator=non_negative)
    betas: tuple[float, float] = attrs.field(default=(0.9, 0.999), validator=adam_betas)
    eps: float = attrs.field(default=1e-8, validator=positive)
    # The max global grad norm; null = no clipping (0 or less is refused: it is not "off").
    grad_clip: float | None = attrs.field(default=1.0, validator=positive)
    lr_schedule: Schedule = "constant"
    warmup_steps: int = attrs.field(default=0, validator=non_negative)
    min_lr_ratio: float = attrs.field(default=0.0, validator=unit_interval)
    # Where the optimizer state lives (`unirl.core.config.optimizer_offload`; `unirl check`
    # prints the choice): cpu keeps the fp32 master weights and Adam moments in host memory and
    # runs the Adam step there (each backend's own way: megatron-core's HybridDeviceOptimizer,
    # FSDP2's CPUOffloadPolicy, DeepSpeed's offload_optimizer); none keeps them on the GPU; auto
    # offloads exactly when the weights, gradients and optimizer state per GPU, counted from
    # the model's shape, exceed offload_state_fraction of offload_gpu_gib. The policy's
    # optimizer only: the critic's is never offloaded, and critic.optimizer.offload* are refused.
    offload: Literal["auto", "none", "cpu"] = "auto"
    # offload: auto's GPU memory in GiB; null: the first visible GPU's (torch.cuda), and with
    # no GPU visible auto does not offload (set this to plan a GPU run from a CPU-only host).
    # Refused with offload: cpu or none (it would change nothing), as offload_state_fraction.
    offload_gpu_gib: float | None = attrs.field(default=None, validator=positive)
    # offload: auto offloads when the resident state exceeds this share of the GPU, leaving
    # the rest to activations, logits and the allocator. 0.8 sits between two measured rows on
    # one 80 GB H100 (benchmarks/results): Qwen3-4B on FSDP2 at 16k tokens fits with its state
    # at 0.76 of the card (75 GiB peak); on Megatron, at 0.85, it does not.
    offload_state_fraction: float = attrs.field(
        default=0.8, validator=in_range(0, 1, low_open=True, why="a share of the GPU's memory")
    )


@attrs.frozen(kw_only=True)
class BatchConfig:
    """Sizes of one RL step. A rollout is ``prompts_per_rollout x samples_per_prompt`` samples,
    cut into optimizer steps of ``samples_per_optimizer_step``, each into microbatches by count
    (``micro_batch_size`` samples per rank) or by a token budget (``max_tokens_per_microbatch``)."""

    prompts_per_rollout: int = attrs.field(default=8, validator=positive)
    samples_per_prompt: int = attrs.field(default=4, validator=positive)
    samples_per_optimizer_step: int = attrs.field(default=32, validator=positive)
    micro_batch_size: int | None = attrs.field(default=None, validator=positive)
    max_tokens_per_microbatch: int | None = attrs.field(default=None, validator=positive)
    epochs_per_rollout: int = attrs.field(default=1, validator=positive)


@attrs.frozen(kw_only=True)
class ParallelConfig:
    tp: int = attrs.field(default=1, validator=positive)
    pp: int = attrs.field(default=1, validator=positive)
    vpp: int | None = attrs.field(default=None, validator=positive)
    cp: int = attrs.field(default=1, validator=positive)
    # Mixture-of-experts layers (Megatron): experts split over ``ep`` ranks, each expert's
    # weights over ``etp`` ranks (None: tp, megatron-core's default); etp x ep x pp divides the
    # world, and the rest is the expert data-parallel size (unirl.core.topology).
    ep: int = attrs.field(default=1, validator=positive)
    etp: int | None = attrs.field(default=None, validator=positive)
    zero_stage: Literal[0, 1, 2, 3] = 0
    # Split the activations between the tensor-parallel matmuls (norms, residuals) along the
    # sequence over the TP ranks (Megatron's sequence parallel): needs tp > 1 and a backend whose
    # plug-in declares `supports_sequence_parallel`.
    sequence_parallel: bool = False
    # None: read WORLD_SIZE from the environment (1 without a launcher).
    world_size: int | None = attrs.field(default=None, validator=positive)
    # How long a collective (and so every rank) waits for a rank that stopped answering before
    # the run fails on every rank; None: 300 s on the CPU (gloo), 1800 s on GPUs (NCCL, whose
    # first collectives and large checkpoint saves can take minutes).
    timeout_s: float | None = attrs.field(default=None, validator=positive)


@attrs.frozen(kw_only=True)
class TrainConfig:
    rl_steps: int = attrs.field(default=10, validator=positive)
    seed: int = 0
    # Stop the run (non-zero exit) after this many optimizer steps in a row were skipped for a
    # non-finite loss or gradient; 0 = never stop for that (non-finite weights always stop it).
    max_consecutive_skipped_steps: int = attrs.field(default=3, validator=non_negative)
    # Asynchronous training: rollout r is generated by the weights after max(0, r - k) RL steps,
    # while earlier rollouts train (unirl.rollouts.async_source); 0 = the synchronous loop.
    max_staleness: int = attrs.field(default=0, validator=non_negative)
