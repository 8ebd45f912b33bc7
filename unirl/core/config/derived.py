"""What the RL step derives from the algorithm section: the loss and advantage settings (built by
`AlgorithmConfig` from the keys declared on the settings fields, `unirl.core.config.sections.feeds`),
whether the reference model runs, and the log-prob specs of the forwards (the head path and the
routing replay they carry to the backends)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from unirl.core.config.head_memory import choose_fused_head
from unirl.core.config.optimizer_offload import choose_optimizer_offload
from unirl.core.maths.advantages import AdvantageSettings
from unirl.core.maths.head_loss import HeadPath, choose_head_path
from unirl.core.maths.logprob_spec import LogprobSpec, RoutingReplay
from unirl.core.maths.losses import LossSettings
from unirl.core.protocols.backend_plugin import BACKENDS

if TYPE_CHECKING:
    from unirl.core.config.run_config import UnirlConfig

logger = logging.getLogger(__name__)


def loss_settings(cfg: UnirlConfig) -> LossSettings:
    """The loss settings of ``cfg.algorithm``, decoupled PPO as for on-policy data
    (``algorithm.decoupled: auto`` is off there; the RL step turns it on per rollout from
    `unirl.core.old_logprobs.decide_decoupled`); a bad value raises `ConfigError` with its key."""
    return cfg.algorithm.loss_settings()


def advantage_settings(cfg: UnirlConfig) -> AdvantageSettings:
    """The advantage settings of ``cfg.algorithm``; a bad value raises `ConfigError` with its
    key."""
    return cfg.algorithm.advantage_settings()


def needs_reference(cfg: UnirlConfig) -> bool:
    """The reference model runs for the KL loss, KL in the reward, and as the distillation
    teacher (on-policy distillation uses model.ref_path as its teacher)."""
    a = cfg.algorithm
    return a.kl_loss.coef > 0 or a.kl_in_reward.coef > 0 or a.distillation_coef > 0


def train_logprob_spec(
    cfg: UnirlConfig, vocab_size: int, *, targets_checked: bool = False
) -> LogprobSpec:
    """``targets_checked``: the caller validated the batch's token ids on the host."""
    entropy_in_loss = cfg.algorithm.entropy_coef != 0
    return LogprobSpec(
        targets_checked=targets_checked,
        temperature=cfg.rollout.temperature,
        vocab_size=vocab_size,
        with_entropy=True,  # entropy is always reported; its gradient only when it is in the loss
        entropy_grad=entropy_in_loss,
        loss_in_head=head_path(cfg).loss_in_head,
        # R2 and R3 alike replay in training: the experts each microbatch carries
        routing="off" if routing_replay(cfg) == "off" else "replay",
    )


def head_path(cfg: UnirlConfig) -> HeadPath:
    """How the training forward's last layer meets the loss, and why (`unirl check` prints it):
    with the fused head (`choose_fused_head`: forced, or chosen from the logits' bytes) the loss
    inside the head when it is separable over tokens (`choose_head_path`), else the head's
    log-probs and then the loss."""
    fused = choose_fused_head(cfg)
    if not fused.fused:
        return HeadPath(False, f"{fused.reason}; logits from the LM head, then the loss")
    path = choose_head_path(loss_settings(cfg))
    if path.loss_in_head and not BACKENDS.get(cfg.backend).supports_loss_in_head:
        return HeadPath(
            False,
            f"{fused.reason}; fused head log-probs, then the loss (4 head matmuls): backend "
            f"{cfg.backend} does not take the loss into its fused head (the loss would allow it)",
        )
    return HeadPath(path.loss_in_head, f"{fused.reason}; {path.reason}")


def fused_head(cfg: UnirlConfig) -> bool:
    """Whether the backends build the fused head (`choose_fused_head`); every backend reads this,
    never ``model.fused_head`` itself (which may be ``auto``)."""
    return choose_fused_head(cfg).fused


def optimizer_offload(cfg: UnirlConfig) -> bool:
    """Whether the policy's optimizer state lives in host memory (`choose_optimizer_offload`);
    every backend reads this, never ``optimizer.offload`` itself (which may be ``auto``), once
    when it builds the policy's optimizer; logged then, since ``auto`` reads the GPU it runs on."""
    choice = choose_optimizer_offload(cfg)
    logger.info("optimizer state: %s", choice.reason)
    return choice.offload


def forward_logprob_spec(
    cfg: UnirlConfig, vocab_size: int, *, targets_checked: bool = False
) -> LogprobSpec:
    """The policy's forward-only spec (the reference's: routing ``off``). ``targets_checked``:
    the caller validated the batch's token ids on the host."""
    return LogprobSpec(
        temperature=cfg.rollout.temperature,
        vocab_size=vocab_size,
        targets_checked=targets_checked,
        routing=routing_replay(cfg),
    )


def routing_replay(cfg: UnirlConfig) -> RoutingReplay:
    """The policy's forward-only pass under ``algorithm.routing_replay``: ``record`` (R2: it
    records, the training replays that), ``replay`` (R3, ``rollout``: every policy pass replays
    the rollout's experts) or ``off``. The reference and the critic always route freely."""
    mode = cfg.algorithm.routing_replay
    return "replay" if mode == "rollout" else "record" if mode == "record" else "off"
