"""TRL's `GRPOTrainer` with a unirl loss: a subclass that replaces only the loss computation.

TRL keeps its generation, rewards, advantages, reference model and training loop; each training
microbatch's loss is `unirl.losses.policy_loss` on TRL's padded tensors::

    trainer = UnirlGRPOTrainer(
        model=model_dir, reward_funcs=reward_fn, args=GRPOConfig(...), train_dataset=dataset,
        loss_settings=LossSettings(policy_loss="cispo", clip_low=1.0, clip_high=4.0),
    )

What maps where: TRL's completion (and tool) mask is unirl's mask; ``old_per_token_logps``
(None when TRL reuses the training forward's) the old log-probs; vLLM's
``sampling_per_token_logps`` the rollout log-probs of ``LossSettings.rollout_correction``;
``ref_per_token_logps`` the reference (TRL computes them only when ``GRPOConfig.beta != 0``; the
KL coefficient and estimator are ``LossSettings.kl_loss_coef`` / ``kl_loss_estimator``).
``loss_type``, ``epsilon*`` and ``delta`` of the GRPOConfig are NOT read: ``LossSettings`` says it.

Normalisation: unirl divides by the counts of the whole optimizer step, summed over every
process and accumulation microbatch: TRL's ``num_items_in_batch`` (valid tokens of the generation
batch) and the non-empty completions counted the same way. That is exactly the optimizer step when
``steps_per_generation == gradient_accumulation_steps`` (TRL's default), which is required. The
loss is multiplied by the process count because DDP averages gradients over processes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from trl import GRPOTrainer

from unirl.core.errors import ConfigError
from unirl.core.maths.losses import LossSettings
from unirl.losses import policy_loss

logger = logging.getLogger(__name__)

# Inputs TRL's _compute_loss forwards to the model (multimodal batches).
_MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


# unirl metric -> TRL's name for the same quantity (TRL's region clip ratio counts the tokens whose
# clipped branch is taken, as pg_clipfrac does). Values are this process's, not gathered.
_TRL_METRIC_NAMES = {"entropy": "entropy", "kl": "kl", "pg_clipfrac": "clip_ratio/region_mean"}


class UnirlGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` whose loss is unirl's (``loss_settings``; default: PPO-clip 0.2 / 0.2,
    token-mean)."""

    def __init__(self, *args: Any, loss_settings: LossSettings | None = None, **kwargs: Any):
        self.unirl_settings = LossSettings() if loss_settings is None else loss_settings
        if not isinstance(self.unirl_settings, LossSettings):
            raise ConfigError(
                "UnirlGRPOTrainer: loss_settings must be a unirl LossSettings, got "
                f"{type(loss_settings).__name__}"
            )
        super().__init__(*args, **kwargs)
        self._refuse_ignored_trl_options()
        logger.info("UnirlGRPOTrainer: the loss is unirl's, %s", self.unirl_settings)

    def _refuse_ignored_trl_options(self) -> None:
        """TRL options this loss would silently skip are refused at setup, with the fix."""
        args, s = self.args, self.unirl_settings
        if args.steps_per_generation != args.gradient_accumulation_steps:
            raise ConfigError(
                f"GRPOConfig.steps_per_generation={args.steps_per_generation} != "
                f"gradient_accumulation_steps={args.gradient_accumulation_steps}: TRL's token "
                "count then spans more than one optimizer step and unirl's normalisation would be "
                "off; set steps_per_generation to gradient_accumulation_steps (or leave it unset)"
            )
        ignored = {
            "top_entropy_quantile": args.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
            "entropy_coef": self._entropy_bonus_enabled,
            "use_bias_correction_kl": args.beta != 0.0 and args.use_bias_correction_kl,
            "vllm_importance_sampling_correction": self.use_vllm
            and self.vllm_importance_sampling_correction,
        }
        bad = [k for k, v in ignored.items() if v]
        if bad:
            raise ConfigError(
                f"UnirlGRPOTrainer: GRPOConfig.{', '.join(bad)} would be ignored by the unirl "
                "loss; turn them off and use LossSettings (entropy_coef, rollout_correction: "
                "tis / icepop / seq_mask) instead"
            )
        if s.kl_loss_coef != 0 and self.beta == 0.0:
            raise ConfigError(
                f"LossSettings.kl_loss_coef={s.kl_loss_coef} needs the reference log-probs, which "
                "TRL computes only when GRPOConfig.beta != 0: set beta to any non-zero value "
                "(unirl's kl_loss_coef is the coefficient used)"
            )

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        out = super()._generate_and_score_completions(inputs)
        mask = out["completion_mask"]
        if out.get("tool_mask") is not None:
            mask = mask * out["tool_mask"]
        # Counted like num_items_in_batch: over every process of the generation batch.
        out["num_sequences_in_batch"] = self.accelerator.gather((mask.sum(-1) > 0).sum()).sum()
        return out

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = (
            completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        )
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in _MODEL_INPUTS},
        )
        loss, metrics = policy_loss(
            self.unirl_settings.policy_loss,
            logps,
            inputs.get("old_per_token_logps"),
            inputs["advantages"],
            mask,
            settings=self.unirl_settings,
            rollout_logprobs=inputs.get("sampling_per_token_logps"),
            ref_logprobs=inputs.get("ref_per_token_logps"),
            entropy=entropies,
            # both counted over every process of the generation batch (= the optimizer step)
            global_tokens=inputs["num_items_in_batch"],
            global_sequences=inputs["num_sequences_in_batch"],
            norm_length=self.max_completion_length,  # TRL's Dr.GRPO constant
        )
        # This microbatch's share of the step; DDP averages over processes, so scale it back.
        loss = loss * self.accelerator.num_processes
        mode = "train" if self.model.training else "eval"
        if self.aux_loss_enabled:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
        for name, value in metrics.items():
            self._metrics[mode][f"unirl/{name}"].append(value)
            if name in _TRL_METRIC_NAMES:  # also under TRL's own name, for existing dashboards
                self._metrics[mode][_TRL_METRIC_NAMES[name]].append(value)
        return loss
