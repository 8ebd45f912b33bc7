"""The one fixture set of the contract suite: a tiny Llama-style model, a rollout batch, and the
run configurations (variants) every backend x layout executes.

Everything here is deterministic (fixed seeds) and written once; the backend harness, the
independent reference and the GPU table all read it from here.

- Model: vocab 64, hidden 32, 4 layers (one per virtual stage at PP = 2 x VPP = 2), 4 heads,
  2 kv heads, untied embeddings, initialised with a larger std than usual (0.2) so log-probs
  spread over several nats and a misaligned or mis-tempered log-prob cannot hide near ``-ln 64``.
- Batch: 3 groups x 4 samples with varied prompt / response lengths, a one-token response, a
  loss mask with holes (a masked tool output), a fully masked response, rewards, rollout
  log-probs (the true ones perturbed; the second response token of every sample is made 1.5 nats
  less likely, so ratios of ~4.5 exercise the clip and dual-clip branches) and reference
  log-probs (a different perturbation, so the KL is not zero).
- Variants: each value of each axis at least once (policy loss, KL estimator, aggregation), plus
  microbatching, reuse / recompute and the checkpoint run.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

MODEL_SEED = 1234
DATA_SEED = 4321
TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "attention_dropout": 0.0,
}

SAMPLES_PER_PROMPT = 4
MAX_SEQ_LEN = 16
MICRO_BATCH_SIZE = 3  # the base split: 12 samples -> 4 microbatches on 1 rank, 2 on each of 2
MAX_NEW_TOKENS = 12
TEMPERATURE = 0.9
NORM_LENGTH = 16  # Dr.GRPO's constant, for seq-mean-token-sum-norm
ROLLOUT_NOISE = 0.1  # std of the rollout log-probs' perturbation (nats)
ROLLOUT_SHIFT = 1.5  # the second response token's rollout log-prob is this much lower
REF_NOISE = 0.3  # std of the reference log-probs' perturbation

# (group, prompt length, response length, reward, loss mask or None = all ones)
SAMPLES: tuple[tuple[int, int, int, float, tuple[int, ...] | None], ...] = (
    (0, 3, 6, 1.0, None),
    (0, 2, 1, 0.0, None),  # a one-token response
    (0, 5, 9, 0.5, None),  # the longest sample: 14 tokens
    (0, 4, 4, 0.0, None),
    (1, 1, 7, 0.2, None),  # a one-token prompt
    (1, 3, 3, 0.9, None),
    (1, 2, 10, -0.3, None),
    (1, 6, 2, 0.9, None),
    (2, 4, 5, 1.0, (1, 1, 0, 0, 1)),
    (2, 2, 8, 0.0, (1, 1, 1, 0, 0, 0, 1, 1)),  # a masked tool output inside the response
    (2, 3, 3, 0.0, (0, 0, 0)),  # nothing to train on: adds nothing to any mean
    (2, 1, 6, 1.0, None),
)
NUM_SAMPLES = len(SAMPLES)
# Samples the rollout engine cut at its length limit (``metadata.finished: false``): the longest
# response of group 0 and of group 1; ``algorithm.mask_truncated`` trains none of their tokens.
TRUNCATED = (2, 6)
NUM_GROUPS = NUM_SAMPLES // SAMPLES_PER_PROMPT
# The tokens the loss sees (loss mask 1): the denominator of every fraction-of-tokens metric.
VALID_TOKENS = sum(sum(mask) if mask is not None else r for _, _, r, _, mask in SAMPLES)

# Optimizer settings. eps is of the order of the gradient entries so that the first AdamW update
# depends on each gradient's size, not only its sign (with eps << |g| the first update is
# lr * sign(g) and would hide a wrong gradient scale); grad_clip is below the step's gradient
# norm so clipping is active (the reference asserts both).
OPTIMIZER = {
    "lr": 1e-2,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "eps": 1e-3,
    "grad_clip": 0.5,
    "lr_schedule": "constant",
}
# grad_clip per fixture init std, each below every variant's gradient norm on its fixture so that
# clause 3 tests clipping everywhere. The std-0.02 fixture (the GPU table's bf16 runs) has
# gradients ~3x smaller: its smallest norm is 0.44 (reinforce_lowvar_seq_mean_token_sum_norm,
# fp32 reference, 4 layers), under the default 0.5.
GRAD_CLIP_BY_INIT_STD = {0.2: 0.5, 0.02: 0.2}


# -- the model ------------------------------------------------------------------------------


def write_tiny_model(path: Path) -> Path:
    """Build the tiny Llama with a fixed seed and `save_pretrained` it (safetensors) to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    model.save_pretrained(path)
    return path


# -- the batch ------------------------------------------------------------------------------


def token_ids() -> list[tuple[list[int], list[int]]]:
    """Prompt and response token ids of every sample (seeded)."""
    g = torch.Generator().manual_seed(DATA_SEED)
    vocab = TINY_LLAMA["vocab_size"]
    out = []
    for _, p, r, _, _ in SAMPLES:
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append((ids[:p], ids[p:]))
    return out


def make_records(true_logprobs: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The rollout batch as plain records (what `RolloutBatch.from_records` reads), given each
    response's true log-probs at the rollout temperature under the initial model."""
    g = torch.Generator().manual_seed(DATA_SEED + 1)
    records = []
    for i, ((group, _, r, reward, mask), (prompt, response), true) in enumerate(
        zip(SAMPLES, token_ids(), true_logprobs)
    ):
        assert true.shape == (r,)
        rollout = true + ROLLOUT_NOISE * torch.randn(r, generator=g, dtype=torch.float64)
        if r > 1:
            rollout[1] -= ROLLOUT_SHIFT
        ref = true + REF_NOISE * torch.randn(r, generator=g, dtype=torch.float64)
        records.append(
            {
                "prompt_tokens": prompt,
                "response_tokens": response,
                "reward": reward,
                "group_id": group,
                "loss_mask": list(mask) if mask is not None else [1] * r,
                "rollout_logprobs": rollout.clamp(max=0.0).tolist(),
                "ref_logprobs": ref.clamp(max=0.0).tolist(),
                "metadata": {"finished": i not in TRUNCATED},
            }
        )
    return records


def select_fields(records: list[dict[str, Any]], data: tuple[str, ...]) -> list[dict[str, Any]]:
    """Records keeping only the optional per-token fields named in `data`."""
    optional = {"rollout_logprobs", "ref_logprobs", "routed_experts"}
    return [{k: v for k, v in rec.items() if k not in optional or k in data} for rec in records]


# -- run configurations -----------------------------------------------------------------------


def base_config(
    *,
    backend: str,
    model_dir: str,
    world_size: int,
    parallel: Mapping[str, Any],
    dtype: str,
    run_dir: str,
    options: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The config every variant starts from (a plain dict for `config_from_dict`); ``options``:
    keys of the backend's own section that the layout sets; ``model``: its model keys."""
    return {
        "backend": backend,
        backend: dict(options or {}),
        "old_logprobs": "auto",
        "model": {
            "path": model_dir,
            "dtype": dtype,
            "max_seq_len": MAX_SEQ_LEN,
            **dict(model or {}),
        },
        "optimizer": {**OPTIMIZER, "grad_clip": grad_clip(model_dir)},
        "batch": {
            "prompts_per_rollout": NUM_GROUPS,
            "samples_per_prompt": SAMPLES_PER_PROMPT,
            "samples_per_optimizer_step": NUM_SAMPLES,  # one optimizer step per rollout
            "micro_batch_size": MICRO_BATCH_SIZE,
        },
        "parallel": {**parallel, "world_size": world_size},
        "algorithm": {"advantage_estimator": "grpo"},
        "rollout": {"temperature": TEMPERATURE, "max_new_tokens": MAX_NEW_TOKENS},
        "train": {"seed": 0},
        "progress": {"enabled": True},
        "logging": {"run_dir": run_dir, "tensorboard": False},
    }


def grad_clip(model_dir: str | Path) -> float:
    """The fixture's grad_clip, from the init std written in its model's config
    (`GRAD_CLIP_BY_INIT_STD`): the worker processes find it from the model folder alone."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    std = config["initializer_range"]
    if std not in GRAD_CLIP_BY_INIT_STD:
        raise KeyError(
            f"fixture init std {std} has no grad_clip in GRAD_CLIP_BY_INIT_STD: pick one below "
            "every variant's reference gradient norm on that fixture"
        )
    return GRAD_CLIP_BY_INIT_STD[std]


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in section by section (None deletes a key)."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = copy.deepcopy(value)
    return out


# Each variant: config overrides, and which optional per-token fields the rollout carries.
# Without "ref_logprobs" in the data and with a KL term, the reference MODEL runs.
_PPO_DUAL = {
    "old_logprobs": "rollout",
    "algorithm": {
        "policy_loss": "ppo_clip",
        "clip_low": 0.2,
        "clip_high": 0.28,  # DAPO's clip-higher
        "dual_clip": 3.0,
        "loss_aggregation": "token-mean",
        "kl_loss": {"coef": 0.1, "estimator": "k1"},
        "entropy_coef": 0.01,
    },
}
BOTH = ("rollout_logprobs", "ref_logprobs")

VARIANTS: dict[str, dict[str, Any]] = {
    "ppo_dual_k1_token_mean": {"overrides": _PPO_DUAL, "data": BOTH},
    "gspo_k2_seq_mean_token_mean": {
        "overrides": {
            "old_logprobs": "rollout",
            "algorithm": {
                "policy_loss": "gspo",
                "clip_low": 0.1,
                "clip_high": 0.15,
                "loss_aggregation": "seq-mean-token-mean",
                "kl_loss": {"coef": 0.05, "estimator": "k2"},
            },
        },
        "data": BOTH,
    },
    "cispo_k3_seq_mean_token_sum": {
        "overrides": {
            "old_logprobs": "rollout",
            "algorithm": {
                "policy_loss": "cispo",
                "clip_low": 0.2,
                "clip_high": 0.28,
                "loss_aggregation": "seq-mean-token-sum",
                "kl_loss": {"coef": 0.05, "estimator": "k3"},
            },
        },
        "data": BOTH,
    },
    "reinforce_lowvar_seq_mean_token_sum_norm": {
        "overrides": {
            "algorithm": {
                "policy_loss": "reinforce",
                "loss_aggregation": "seq-mean-token-sum-norm",
                "norm_length": NORM_LENGTH,
                "kl_loss": {"coef": 0.05, "estimator": "low_var_kl"},
            },
        },
        "data": BOTH,
    },
    "ppo_k3plus_seq_mean_token_mean": {
        "overrides": {
            "old_logprobs": "rollout",
            "algorithm": {
                "policy_loss": "ppo_clip",
                "loss_aggregation": "seq-mean-token-mean",
                "kl_loss": {"coef": 0.2, "estimator": "k3+"},
            },
        },
        "data": BOTH,
    },
    # Clause 4: the first variant again, split differently.
    "ppo_dual_mbs1": {
        "overrides": merged(_PPO_DUAL, {"batch": {"micro_batch_size": 1}}),
        "data": BOTH,
        "same_as": "ppo_dual_k1_token_mean",
    },
    "ppo_dual_token_budget": {
        "overrides": merged(
            _PPO_DUAL, {"batch": {"micro_batch_size": None, "max_tokens_per_microbatch": 24}}
        ),
        "data": BOTH,
        "same_as": "ppo_dual_k1_token_mean",
    },
    # DAPO's truncation mask: the cut samples train no token and leave the step's token and
    # sequence counts (the seq-mean denominators), while their rewards stay in their groups'
    # baselines.
    "mask_truncated_seq_mean_token_mean": {
        "overrides": {
            "old_logprobs": "rollout",
            "algorithm": {
                "policy_loss": "ppo_clip",
                "loss_aggregation": "seq-mean-token-mean",
                "mask_truncated": True,
                "kl_loss": {"coef": 0.05, "estimator": "k3"},
            },
        },
        "data": BOTH,
    },
    # Clause 5: TIS makes the loss read the old log-probs even at ratio 1.
    "reuse": {
        "overrides": {
            "old_logprobs": "reuse",
            "algorithm": {
                "policy_loss": "ppo_clip",
                "loss_aggregation": "token-mean",
                "rollout_correction": {"mode": "tis", "low": 0.5, "high": 2.0},
            },
        },
        "data": BOTH,
    },
    "recompute": {
        "overrides": {
            "old_logprobs": "recompute",
            "algorithm": {
                "policy_loss": "ppo_clip",
                "loss_aggregation": "token-mean",
                "rollout_correction": {"mode": "tis", "low": 0.5, "high": 2.0},
            },
        },
        "data": BOTH,
        "same_as": "reuse",
    },
}

# Clause 7: several RL steps on the same rollout, with the KL to the reference MODEL (the data has
# no reference log-probs), so the reference forward and its weights are part of the state.
RESUME = {
    "overrides": {
        "algorithm": {
            "policy_loss": "ppo_clip",
            "loss_aggregation": "seq-mean-token-mean",
            "kl_loss": {"coef": 0.2, "estimator": "low_var_kl"},
        },
    },
    "data": (),
}
RESUME_STEPS = 3  # n
RESUME_SAVE_AFTER = 1  # k


def variant_config(base: Mapping[str, Any], variant: Mapping[str, Any]) -> dict[str, Any]:
    return merged(base, variant["overrides"])


def micro_batch_size(variant: Mapping[str, Any]) -> int | None:
    """The variant's samples per microbatch; None with a token budget."""
    batch = merged({"micro_batch_size": MICRO_BATCH_SIZE}, variant["overrides"].get("batch", {}))
    return batch.get("micro_batch_size")
