"""TRL's GRPOTrainer with a unirl loss (`unirl.integrations.trl`), on a tiny seeded model built
here (no hub): where TRL's loss and unirl's coincide, the same batch gives the same loss and
gradients (1e-6, fp32), alone and as one of two gradient-accumulation microbatches of a step;
with a loss TRL lacks, a short run trains and its reward rises."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

for _var in (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY",
):
    os.environ.setdefault(_var, "1")

if importlib.util.find_spec("trl") is None:
    pytest.skip(
        "trl is not installed: `pip install -e '.[test]'` installs it", allow_module_level=True
    )

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from unirl.core.errors import ConfigError  # noqa: E402
from unirl.core.maths.losses import LossSettings  # noqa: E402
from unirl.integrations.trl import UnirlGRPOTrainer  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>", "a", "b", "c", "x", "y", "z"]
MAX_COMPLETION = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A 1-layer Llama and a word-level tokenizer, saved where TRL loads policy and reference."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return Dataset.from_dict({"prompt": ["a b", "b c", "c a", "a c"] * 8})


def reward_fn(completions, **kwargs) -> list[float]:
    """Fraction of the completion's 4 slots that say "x"."""
    return [c.split().count("x") / MAX_COMPLETION for c in completions]


def _config(tmp_path, **kwargs) -> GRPOConfig:
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    return GRPOConfig(**{**base, **kwargs})


def _batch(trainer, beta: bool, accumulation: int = 1):
    """A hand-made microbatch: ragged completions, ratios spread over every clip branch. With
    ``accumulation`` > 1 it is one of that many microbatches of the step: the step's counts are
    larger than its own."""
    g = torch.Generator().manual_seed(1)
    b = 8
    completion_ids = torch.randint(3, len(WORDS), (b, MAX_COMPLETION), generator=g)
    lengths = torch.tensor([4, 1, 3, 4, 2, 4, 3, 1])
    completion_mask = (torch.arange(MAX_COMPLETION)[None, :] < lengths[:, None]).long()
    prompt_ids = torch.randint(3, 6, (b, 2), generator=g)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": completion_mask.sum() + 13 * (accumulation - 1),
        "num_sequences_in_batch": torch.tensor(b * accumulation),
    }
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([prompt_ids, completion_ids], 1),
            torch.cat([inputs["prompt_mask"], completion_mask], 1),
            MAX_COMPLETION,
        )
    old = logps + 0.4 * torch.randn(logps.shape, generator=g)
    old[0] = logps[0] - 1.5  # ratio e^1.5 = 4.5: past the dual-clip bound 3
    inputs["advantages"][0] = -1.0
    inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.3 * torch.randn(logps.shape, generator=g)
    return inputs


def _loss_and_grads(trainer, inputs, accumulation: int = 1):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


# TRL GRPOConfig options <-> the unirl LossSettings that computes the same loss.
CASES = {
    "dapo_token_mean": (
        dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
        LossSettings(clip_low=0.2, clip_high=0.28),
    ),
    "grpo_seq_mean": (dict(loss_type="grpo"), LossSettings(loss_aggregation="seq-mean-token-mean")),
    "dapo_delta_is_dual_clip": (
        dict(loss_type="dapo", delta=3.0),
        LossSettings(dual_clip=3.0),
    ),
    "cispo": (
        dict(loss_type="cispo", epsilon_high=1.3),  # TRL's bound is absolute: clip_high = 0.3
        LossSettings(policy_loss="cispo", clip_low=1.0, clip_high=0.3),
    ),
    "sequence_level_is_gspo": (
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1),
        LossSettings(
            policy_loss="gspo", loss_aggregation="seq-mean-token-mean", clip_low=0.1, clip_high=0.1
        ),
    ),
    "dr_grpo": (
        dict(loss_type="dr_grpo"),
        LossSettings(loss_aggregation="seq-mean-token-sum-norm"),
    ),
    "dapo_k3_kl": (
        dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=False),
        LossSettings(kl_loss_coef=0.04, kl_loss_estimator="k3"),
    ),
}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_unirl_loss_equals_trl_loss(case, accumulation, model_dir, dataset, tmp_path):
    trl_kwargs, settings = CASES[case]
    beta = trl_kwargs.get("beta", 0.0)
    # TRL computes the reference log-probs only with beta != 0; unirl's coefficient is its own.
    kl_args = dict(beta=beta, use_bias_correction_kl=False) if beta else {}
    trl_trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=reward_fn,
        train_dataset=dataset,
        args=_config(tmp_path, gradient_accumulation_steps=accumulation, **trl_kwargs),
    )
    unirl_trainer = UnirlGRPOTrainer(
        model=model_dir,
        reward_funcs=reward_fn,
        train_dataset=dataset,
        args=_config(tmp_path, gradient_accumulation_steps=accumulation, **kl_args),
        loss_settings=settings,
    )
    inputs = _batch(trl_trainer, beta=beta != 0.0, accumulation=accumulation)
    ref_loss, ref_grads = _loss_and_grads(trl_trainer, inputs, accumulation)
    loss, grads = _loss_and_grads(unirl_trainer, inputs, accumulation)

    assert set(grads) == set(ref_grads) and ref_loss != 0
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    assert max(g.abs().max() for g in grads.values()) > 1e-3  # a gradient worth comparing


def test_trl_options_the_loss_would_ignore_are_refused(model_dir, dataset, tmp_path):
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        UnirlGRPOTrainer(
            model=model_dir,
            reward_funcs=reward_fn,
            train_dataset=dataset,
            args=_config(tmp_path, top_entropy_quantile=0.5),
        )
    with pytest.raises(ConfigError, match="beta"):
        UnirlGRPOTrainer(
            model=model_dir,
            reward_funcs=reward_fn,
            train_dataset=dataset,
            args=_config(tmp_path),
            loss_settings=LossSettings(kl_loss_coef=0.1),
        )


def test_readme_snippet_trains_with_a_loss_trl_lacks(model_dir, dataset, tmp_path):
    """REINFORCE (no ratio, no clip; TRL has none) with per-sequence mean aggregation: the
    snippet of docs/guides/integrations.md, run as written, on the "say x" task; the reward climbs from ~0.1."""
    from tests.unit.doc_snippets import doc_snippet

    grpo_config = _config(tmp_path, learning_rate=2e-2, max_steps=10, logging_steps=1)
    scope = {
        "model_dir": model_dir,
        "reward_fn": reward_fn,
        "dataset": dataset,
        "grpo_config": grpo_config,
    }
    exec(doc_snippet("guides/integrations.md", "trl"), scope)
    history = scope["trainer"].state.log_history
    assert {"unirl/loss", "unirl/pg_loss", "entropy"} <= set(history[0])  # unirl's metrics logged
    rewards = [h["reward"] for h in history if "reward" in h]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.3 and last > first + 0.4, rewards


@pytest.mark.parametrize("mode", ["tis", "icepop"])
def test_rollout_correction_equals_trl_vllm_importance_sampling(mode, model_dir, dataset, tmp_path):
    """Dual clip with TIS / IcePop, as TRL does them with vLLM (``token_truncate`` /
    ``token_mask``): TRL multiplies its loss by the ratio its generation step computed; that ratio
    is written out here by hand from the sampling log-probs, and TRL's multiplication path is
    switched on without a vLLM server (the flags are read only there)."""
    trl_trainer = GRPOTrainer(
        model=model_dir, reward_funcs=reward_fn, train_dataset=dataset,
        args=_config(tmp_path, loss_type="dapo", delta=3.0),
    )  # fmt: skip
    trl_trainer.use_vllm = trl_trainer.vllm_importance_sampling_correction = True
    settings = LossSettings(dual_clip=3.0, rollout_correction=mode)  # bounds 0.5, 2.0
    unirl_trainer = UnirlGRPOTrainer(
        model=model_dir, reward_funcs=reward_fn, train_dataset=dataset,
        args=_config(tmp_path), loss_settings=settings,
    )  # fmt: skip
    inputs = _batch(trl_trainer, beta=False)
    g = torch.Generator().manual_seed(2)
    sampling = inputs["old_per_token_logps"] + 0.6 * torch.randn((8, MAX_COMPLETION), generator=g)
    rho = torch.exp(inputs["old_per_token_logps"] - sampling)
    if mode == "tis":
        weight = rho.clamp(max=2.0)  # truncated at the upper bound
    else:
        weight = torch.where((rho >= 0.5) & (rho <= 2.0), rho, torch.zeros(()))  # masked outside
    mask = inputs["completion_mask"].bool()
    assert (rho[mask] > 2.0).any() and (rho[mask] < 2.0).any()  # truncated or dropped tokens
    inputs.update(sampling_per_token_logps=sampling, importance_sampling_ratio=weight)

    ref_loss, ref_grads = _loss_and_grads(trl_trainer, inputs)
    loss, grads = _loss_and_grads(unirl_trainer, inputs)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
