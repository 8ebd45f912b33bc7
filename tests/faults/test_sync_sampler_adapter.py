"""Adapter-only sync into the built-in sampler (``model.lora``): after each sync the sampler's
log-probs of its own samples are those of the trainer's model, computed here with peft (the base
model + a peft LoRA adapter holding the synced tensors, fp32); its base weights stay bit for bit
what they were; a dropped adapter sync (tests/faults/inject.py ``drop_adapter_sync``) is caught
by the verified sync with `SyncVerificationError`, and passes unnoticed without it (the sampler
then serves the previous adapter: its log-probs leave the trainer's); a base weight changed
behind the sync's back is caught too. `WeightSync` sends only the adapter and counts its bytes."""

from __future__ import annotations

import copy
from pathlib import Path

import peft  # the test extra's
import pytest
import torch

from tests.faults import inject
from unirl.core.config.run_config import load_config
from unirl.core.weight_sync import WeightSync
from unirl.core.weights.fingerprint import SyncVerificationError
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import build_rollout_source
from unirl.rollouts.sampler_source import SamplerRolloutSource

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"
RANK, ALPHA = 4, 8.0
PROMPT = [1, 5, 6, 3]  # <bos> 1 2 <sep>: a prompt of the reverse task's vocabulary
TEMPERATURE = 0.7


def _source(tmp_path: Path, verify: bool = True) -> tuple[object, SamplerRolloutSource]:
    cfg = load_config(
        EXAMPLE,
        [
            f"logging.run_dir={tmp_path / 'run'}",
            f"model.lora={{rank: {RANK}, alpha: {ALPHA}}}",
            f"rollout.verify_sync={str(verify).lower()}",
            f"rollout.temperature={TEMPERATURE}",
        ],
    )
    source = build_rollout_source(cfg)
    assert isinstance(source, SamplerRolloutSource)
    return cfg, source


class Trainer:
    """The trainer's model as the test computes it: the base + a peft adapter, fp32."""

    def __init__(self, base: torch.nn.Module, targets: tuple[str, ...]) -> None:
        config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets))
        self.model = peft.get_peft_model(copy.deepcopy(base), config).eval()
        self.version = 0

    def step(self) -> dict[str, torch.Tensor]:
        """A new adapter (every A and B moved, B away from zero), as an optimizer step makes."""
        self.version += 1
        g = torch.Generator().manual_seed(self.version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        return {k: v.clone() for k, v in peft.get_peft_model_state_dict(self.model).items()}

    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """log softmax(logits / T) of each response token after PROMPT."""
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([PROMPT + tokens])).logits[0].float()
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        rows = torch.arange(len(PROMPT) - 1, len(PROMPT) + len(tokens) - 1)
        return logp[rows, torch.tensor(tokens)]


def _follows(source: SamplerRolloutSource, trainer: Trainer) -> bool:
    gen = source.sampler.generate([PROMPT])[0]
    return torch.allclose(gen.logprobs, trainer.logprobs(gen.response_tokens.tolist()), atol=1e-5)


def _base(source: SamplerRolloutSource) -> torch.nn.Module:
    """The trainer's base model: other weights than the sampler was built with (a seed of its
    own), which reach the sampler only through the base sync."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(source.sampler.model.config).float().eval()


def _setup(tmp_path: Path, verify: bool = True):
    cfg, source = _source(tmp_path, verify)
    base = _base(source)
    source.sync_weights(as_buckets(base.state_dict()), policy_version=0)  # the base, once
    return source, base, Trainer(base, cfg.model.lora.target_modules)


def test_the_sampler_follows_the_trainers_adapter_and_keeps_its_base(tmp_path):
    source, base, trainer = _setup(tmp_path)
    for version in (1, 2, 3):
        source.sync_adapter(trainer.step(), policy_version=version)
        assert source.rollout_metrics()["time/verify_s"] > 0
        assert _follows(source, trainer), f"version {version}"
    held = dict(source.sampler.model.named_parameters())
    for name, p in base.named_parameters():  # the base weights, bit for bit
        module, leaf = name.rsplit(".", 1)
        twin = held.get(name, held.get(f"{module}.base_layer.{leaf}"))
        assert twin is not None and torch.equal(twin, p), name


@pytest.mark.parametrize("verify", [True, False])
def test_a_dropped_adapter_sync_is_caught(tmp_path, monkeypatch, verify):
    source, _, trainer = _setup(tmp_path, verify)
    source.sync_adapter(trainer.step(), policy_version=1)
    # the injector patches the library; monkeypatch puts the original back afterwards
    # (both receivers' methods: one left patched dropped the other file's first delivery)
    for cls, method in inject.adapter_delivery():
        monkeypatch.setattr(cls, method, getattr(cls, method))
    inject.drop_adapter_sync("1")  # the next adapter sync is never delivered
    if not verify:  # without the check the sampler goes on with the previous adapter
        source.sync_adapter(trainer.step(), policy_version=2)
        assert not _follows(source, trainer)
        return
    with pytest.raises(SyncVerificationError, match="adapter sync of policy version 2 to the "
                       "sampler's model did not land: layer 0 holds other") as e:  # fmt: skip
        source.sync_adapter(trainer.step(), policy_version=2)
    assert e.value.layer == "layer 0"


def test_a_changed_base_weight_is_caught(tmp_path):
    source, _, trainer = _setup(tmp_path)
    source.sync_adapter(trainer.step(), policy_version=1)
    with torch.no_grad():
        source.sampler.model.model.layers[1].mlp.down_proj.base_layer.weight[0, 0] += 0.5
    with pytest.raises(SyncVerificationError, match="base weights of policy version 2") as e:
        source.sync_adapter(trainer.step(), policy_version=2)
    assert e.value.layer == "layer 1"


class AdapterBackend:
    """What `WeightSync` asks of a backend training an adapter (`TrainsAdapter`)."""

    def __init__(self, trainer: Trainer, base: torch.nn.Module) -> None:
        self.trainer, self.base = trainer, base
        self.adapter = trainer.step()

    def stream_base_weights(self, bucket_bytes: int, *, dst, device=None):
        return as_buckets(self.base.state_dict())

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        return self.adapter

    def export_adapter(self, path: Path) -> None:
        raise AssertionError("a sync never exports")

    def stream_weights(self, *args, **kwargs):
        raise AssertionError("an adapter-only sync streams no full weights")


def test_weight_sync_sends_the_adapter_only(tmp_path):
    from unirl.core.run.divergence import DivergenceGuard

    cfg, source = _source(tmp_path)
    base = _base(source)
    trainer = Trainer(base, cfg.model.lora.target_modules)
    backend = AdapterBackend(trainer, base)
    sync = WeightSync(cfg, backend, source)  # type: ignore[arg-type]
    assert sync.adapter_only
    sync.initial(0)  # the base weights once, then the adapter
    assert _follows(source, trainer)
    # A and B of 7 targets in 2 layers, fp32: hidden 128, intermediate 256, 2 kv heads of 32
    shapes = {"q": (128, 128), "k": (128, 64), "v": (128, 64), "o": (128, 128),
              "gate": (128, 256), "up": (128, 256), "down": (256, 128)}  # fmt: skip
    adapter_bytes = 2 * sum(4 * RANK * (i + o) for i, o in shapes.values())
    base_bytes = 4 * sum(p.numel() for p in base.parameters())
    assert sync.last_bytes == base_bytes + adapter_bytes
    backend.adapter = trainer.step()
    sync.after_step(1, {}, DivergenceGuard(3), 1)
    assert sync.last_bytes == adapter_bytes
    assert _follows(source, trainer)


def test_a_job_whose_adapter_sync_is_dropped_stops_and_resumes(job, tmp_path):
    """A real `unirl train` on DeepSpeed under model.lora (examples/tiny_grpo_lora.yaml): the
    third adapter sync (after RL step 2) is never delivered; the run ends with one error line
    naming it, the step-1 checkpoint intact, and --resume (whose first sync sends the base
    weights again, not the merged ones) finishes with the sampler following the trainer."""
    from tests.faults.conftest import metric_steps, newest_checkpoint
    from unirl.core.run.metrics_log import read_metrics

    run = tmp_path / "run"
    args = ["train", str(EXAMPLE.parent / "tiny_grpo_lora.yaml"), "--set", "train.rl_steps=3",
            "--set", f"logging.run_dir={run}", "--set", "checkpoint.every=1",
            "--set", "progress.enabled=false"]  # fmt: skip
    failed = job(args, fault="drop_adapter_sync:3", timeout=300)
    assert failed.returncode != 0
    (line,) = failed.error_lines()
    assert "after RL step 2: the adapter sync of policy version 2 to the sampler's model did " \
        "not land: layer 0" in line, line  # fmt: skip
    assert newest_checkpoint(run)[0] == 1
    done = job([*args, "--resume"], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert metric_steps(run) == [1, 2, 3]
    for record in read_metrics(run / "metrics.jsonl"):
        assert record["train_rollout_logprob_abs_diff_max"] < 1e-5, record
