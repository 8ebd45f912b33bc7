"""Training checkpoints: DeepSpeed's own files (model, ZeRO optimizer partitions, LR scheduler)
and core's client state; `unirl.backends.hf.checkpoint` adds each rank's RNG states and stages
and publishes the folder, so that a crash never leaves a checkpoint that looks complete.

Layout of ``<path>/`` (on a filesystem every rank sees)::

    state/...              engine.save_checkpoint(tag="state"): module (without frozen parameters:
                           under model.lora the adapter only), optimizer (per ZeRO rank),
                           LR scheduler, and {"unirl": client_state}
    critic/...             the critic's engine, the same way (when the run trains one)
    rng_rank00000.pt       python / numpy / torch CPU / CUDA generator states of rank 0, ...
    complete               written last, by rank 0, after every rank has finished

With the same world size and ZeRO stage, a resumed run on the CPU is bit-exact: the same weights,
optimizer moments, learning rate and random streams.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unirl.backends.deepspeed.model import DeepSpeedModel
from unirl.backends.hf.checkpoint import CLIENT_KEY, Marker, Models
from unirl.core.errors import ConfigError

TAG = "state"


def write_files(partial: Path, models: Models, client: Mapping[str, Any], rank: int) -> Marker:
    """Each `DeepSpeedModel`'s engine's own ``save_checkpoint``, the critic's under its name."""
    policy: DeepSpeedModel = models.policy
    policy.engine.save_checkpoint(
        str(partial),
        tag=TAG,
        client_state={CLIENT_KEY: dict(client)},
        save_latest=False,
        exclude_frozen_parameters=True,  # a LoRA policy's frozen base is not saved
    )
    for tag, other in models.extra.items():
        other.engine.save_checkpoint(str(partial), tag=tag, save_latest=False)
    return {"zero_stage": policy.engine.zero_optimization_stage()}


def read_files(path: Path, models: Models) -> dict[str, Any]:
    policy: DeepSpeedModel = models.policy
    load_path, client = policy.engine.load_checkpoint(
        str(path),
        tag=TAG,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
        # a LoRA policy's files hold the adapter only; its base is checked by fingerprint
        load_module_strict=all(p.requires_grad for p in policy.hf_module.parameters()),
    )
    if load_path is None:
        raise ConfigError(f"checkpoint {str(path)!r}: DeepSpeed found no state under tag {TAG!r}")
    for tag, other in models.extra.items():
        if other.engine.load_checkpoint(str(path), tag=tag)[0] is None:
            raise ConfigError(f"checkpoint {str(path)!r}: DeepSpeed found no state under {tag!r}")
    return dict(client[CLIENT_KEY])
