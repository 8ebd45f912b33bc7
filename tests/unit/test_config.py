from pathlib import Path

import pytest
import yaml

from unirl.core.config.run_config import config_from_dict, load_config
from unirl.core.errors import ConfigError

TINY = {"model_type": "llama", "num_hidden_layers": 4, "vocab_size": 32}


def base(**sections):
    data = {
        "backend": "deepspeed",
        "model": {"hf_config": dict(TINY)},
        "batch": {
            "prompts_per_rollout": 4,
            "samples_per_prompt": 4,
            "samples_per_optimizer_step": 8,
            "micro_batch_size": 2,
        },
        "parallel": {"world_size": 2},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


def test_defaults_and_derived_layout():
    cfg = config_from_dict(base())
    # 4 prompts x 4 samples = 16 per rollout; 8 per step -> 2 steps; 8 / dp 2 = 4 per rank;
    # 4 / micro batch 2 = 2 microbatches per step per rank
    lay = cfg.layout
    assert (lay.world_size, lay.dp, lay.rollout_samples) == (2, 2, 16)
    assert (lay.optimizer_steps_per_rollout, lay.samples_per_rank_per_step) == (2, 4)
    assert lay.microbatches_per_step == 2
    assert cfg.algorithm.clip_low == 0.2 and cfg.old_logprobs == "auto"


def test_epochs_multiply_steps_and_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    data = base(batch={"epochs_per_rollout": 3})
    del data["parallel"]
    cfg = config_from_dict(data)
    # dp 4; 8 / 4 = 2 per rank; 16 / 8 = 2 steps x 3 epochs = 6
    assert cfg.layout.dp == 4 and cfg.layout.optimizer_steps_per_rollout == 6


def test_config_is_frozen():
    cfg = config_from_dict(base())
    with pytest.raises(AttributeError):
        cfg.backend = "megatron"  # type: ignore[misc]


@pytest.mark.parametrize(
    "data, message",
    [
        (
            base(algorithm={"clip_lo": 0.1}),
            r"unknown key 'algorithm.clip_lo' \(did you mean 'clip_low'\?\)",
        ),
        (base(bogus=1), r"unknown key 'bogus'"),
        # sections the loader takes out before the check are still suggested and listed
        (
            base(rolout={}),
            r"unknown key 'rolout' \(did you mean 'rollout'\?\); valid keys here: "
            r"\[.*'megatron'.*'rollout'",
        ),
        (base(megatorn={}), r"unknown key 'megatorn' \(did you mean 'megatron'\?\)"),
        (
            base(batch={"micro_batch_size": "2"}),
            r"batch.micro_batch_size: expected an integer, got '2'",
        ),
        (base(optimizer={"lr": "fast"}), r"optimizer.lr: expected a number"),
        (base(progress={"enabled": "yes"}), r"progress.enabled: expected true or false"),
        (
            base(backend="fsdp"),
            r"backend='fsdp' is not a registered backend \(did you mean 'fsdp2'\?\); valid: "
            r"\['deepspeed', 'fsdp2', 'megatron'\]",
        ),
        (base(old_logprobs="sometimes"), r"old_logprobs: 'sometimes' is not valid"),
        (base(parallel={"zero_stage": 4}), r"parallel.zero_stage: 4 is not valid"),
        (base(optimizer={"betas": [0.9]}), r"optimizer.betas: expected a list of 2 values"),
        (base(optimizer={"lr": -1.0}), r"optimizer.lr must be > 0 and <= 1e\+30, got -1.0"),
        (base(model="x"), r"model: expected a mapping"),
        (
            base(parallel={"pp": 2, "world_size": 4}),
            r"parallel.pp=2 is not supported with backend: deepspeed",
        ),
        (
            base(parallel={"cp": 2, "world_size": 4}),
            r"parallel.cp=2 is not supported with backend: deepspeed",
        ),
        (
            base(parallel={"tp": 2, "world_size": 4}),
            r"parallel.tp=2 is not supported with backend: deepspeed",
        ),
        (base(backend="megatron", parallel={"vpp": 2}), r"parallel.vpp=2 needs parallel.pp > 1"),
        (
            base(megatron={"attention": "padded"}),
            r"section 'megatron:' configures backend megatron, but backend: deepspeed",
        ),
        (
            base(backend="megatron", megatron={"attention": "unfused"}, parallel={"cp": 2}),
            r"parallel.cp=2 needs megatron.attention: packed",
        ),
        (
            base(parallel={"sequence_parallel": True}),
            r"parallel.sequence_parallel: true with backend: deepspeed, which has no sequence",
        ),
        (
            base(backend="megatron", parallel={"sequence_parallel": True}),
            r"parallel.sequence_parallel: true needs parallel.tp > 1",
        ),
        (
            base(
                backend="megatron",
                parallel={"sequence_parallel": True, "tp": 2, "cp": 2, "world_size": 4},
            ),
            r"parallel.sequence_parallel: true with parallel.cp=2 is not supported",
        ),
        (
            base(backend="megatron", megatron={"attention": "flash"}),
            r"megatron.attention: 'flash' is not valid",
        ),
        (
            base(backend="megatron", megatron={"experts": "grouped"}),
            r"megatron.experts='grouped' chooses a mixture-of-experts model's experts module; "
            r"model_type='llama' is dense: remove it",
        ),
        (
            base(backend="megatron", megatron={"experts": "fast"}),
            r"megatron.experts: 'fast' is not valid",
        ),
        (base(deepspeed={"extr": {}}), r"unknown key 'deepspeed.extr' \(did you mean 'extra'\?\)"),
        (base(parallel={"vpp": 2}), r"parallel.vpp is set but backend: deepspeed"),
        (
            base(backend="megatron", parallel={"zero_stage": 3}),
            r"parallel.zero_stage=3 with backend: megatron",
        ),
        (
            base(backend="megatron", parallel={"pp": 2, "vpp": 4, "world_size": 2}),
            r"num_hidden_layers=4 is not divisible by parallel.pp x parallel.vpp = 2 x 4",
        ),
        (
            {
                **base(backend="megatron", parallel={"tp": 3, "world_size": 3}),
                "model": {"hf_config": {**TINY, "num_attention_heads": 4}},
            },
            r"parallel.tp=3 does not divide model.hf_config's num_attention_heads=4",
        ),
        (
            {
                **base(backend="megatron", parallel={"tp": 2, "world_size": 2}),
                "model": {
                    "hf_config": {**TINY, "num_attention_heads": 4, "num_key_value_heads": 1}
                },
            },
            r"parallel.tp=2 does not divide model.hf_config's num_key_value_heads=1",
        ),
        (
            base(backend="megatron", parallel={"tp": 2, "world_size": 3}),
            r"world size 3 is not divisible by parallel.tp",
        ),
        (
            base(batch={"samples_per_optimizer_step": 6}),
            r"samples_per_optimizer_step=6 does not divide the rollout",
        ),
        (
            base(batch={"micro_batch_size": 3}),
            r"not divisible by batch.micro_batch_size x data-parallel size = 3 x 2",
        ),
        (
            base(parallel={"world_size": 16}),
            r"samples_per_optimizer_step=8 is not divisible by the data-parallel size 16",
        ),
        (
            base(batch={"micro_batch_size": None}),
            r"set batch.micro_batch_size .* or batch.max_tokens_per_microbatch",
        ),
        (
            base(
                batch={"max_tokens_per_microbatch": 100, "micro_batch_size": None},
                model={"max_seq_len": 512},
            ),
            r"max_tokens_per_microbatch=100 is smaller than model.max_seq_len=512",
        ),
        (base(model={"hf_config": None}), r"set model.path .* or model.hf_config"),
        (base(algorithm={"clip_low": 1.5}), r"algorithm.clip_low=1.5 makes the lower ratio bound"),
        (base(algorithm={"clip_high": -0.1}), r"algorithm.clip_high must be >= 0, got -0.1"),
        (base(algorithm={"dual_clip": 0.5}), r"algorithm.dual_clip=0.5 must be > 1"),
        (
            base(algorithm={"rollout_correction": {"mode": "tis", "low": 3.0, "high": 2.0}}),
            r"algorithm.rollout_correction.low=3.0 / algorithm.rollout_correction.high=2.0 must "
            r"satisfy low <= 1 <= high",
        ),
        (
            base(batch={"max_tokens_per_microbatch": 4096}),
            r"set either batch.micro_batch_size .* not both",
        ),
        (
            base(algorithm={"kl_loss": {"estimator": "k4"}}),
            r"algorithm.kl_loss.estimator='k4' is not one of",
        ),
        (
            base(algorithm={"kl_in_reward": {"estimator": "k9"}}),
            r"algorithm.kl_in_reward.estimator='k9' is not a KL estimator",
        ),
        (
            base(algorithm={"advantage_estimator": "grp"}),
            r"algorithm.advantage_estimator='grp' is not a registered advantage estimator "
            r"\(did you mean 'grpo'\?\)",
        ),
        (base(rollout={"source": "file"}), r"rollout.source: file needs rollout.file"),
        (
            base(old_logprobs="rollout", algorithm={"rollout_correction": {"mode": "tis"}}),
            r"rollout_correction.mode='tis' with old_logprobs: rollout corrects nothing",
        ),
        (
            base(old_logprobs="rollout", algorithm={"decoupled": True}),
            r"algorithm.decoupled: true with old_logprobs: rollout makes the proximal policy",
        ),
        (
            base(algorithm={"decoupled": True, "rollout_correction": {"mode": "icepop"}}),
            r"algorithm.decoupled=True with algorithm.rollout_correction.mode='icepop'",
        ),
        (
            base(algorithm={"decoupled_cap": 0.9}),
            r"algorithm.decoupled_cap=0.9 must be >= 1",
        ),
        (base(rollout={"top_p": 1.5}), r"rollout.top_p must be > 0 and <= 1, got 1.5"),
    ],
)
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(data)


def test_load_yaml_with_overrides(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base()))
    cfg = load_config(
        path, ["batch.micro_batch_size=4", "algorithm.kl_loss.coef=0.01", "backend=megatron"]
    )
    assert cfg.batch.micro_batch_size == 4 and cfg.layout.microbatches_per_step == 1
    assert cfg.algorithm.kl_loss.coef == 0.01 and cfg.backend == "megatron"
    with pytest.raises(ConfigError, match=r"expected key\.path=value"):
        load_config(path, ["batch.micro_batch_size"])
    with pytest.raises(ConfigError, match=r"unknown key .batch\.micro."):
        load_config(path, ["batch.micro=1"])


def test_exponent_without_dot_is_a_number(tmp_path: Path):
    # YAML 1.1 reads 3e-4 as a string; the config takes it as the number users mean
    path = tmp_path / "c.yaml"
    data = base()
    path.write_text(yaml.safe_dump(data) + "optimizer:\n  lr: 3e-4\n")
    assert load_config(path).optimizer.lr == 3e-4
    assert load_config(path, ["optimizer.eps=1E-6"]).optimizer.eps == 1e-6
    with pytest.raises(ConfigError, match=r"optimizer\.lr: expected a number, got '3e-4x'"):
        load_config(path, ["optimizer.lr=3e-4x"])


def test_load_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    bad.write_text("!!python/object:os.system {}")
    with pytest.raises(ConfigError, match="not valid YAML"):  # safe loader refuses objects
        load_config(bad)


def test_to_dict_round_trips():
    cfg = config_from_dict(base(algorithm={"kl_loss": {"coef": 0.1}}))
    again = config_from_dict(cfg.to_dict())
    assert again == cfg


def test_model_path_and_hf_config_together_are_refused():
    """One rule for every component: the Hugging Face backends loaded the folder while Megatron's
    expert-parallel and routing rules read hf_config (a MoE folder over a dense example's
    hf_config was refused on Megatron as dense)."""
    with pytest.raises(ConfigError, match=r"model.path='/m' and model.hf_config are both set.*"
                       r"--set model.hf_config=null"):  # fmt: skip
        config_from_dict({"model": {"path": "/m", "hf_config": {"model_type": "llama"}}})
