"""Fault injection: a weight sync into the built-in sampler that lands partly is caught by the
verified sync (rollout.verify_sync, on by default), naming the layer and the policy version; the
training loop's sync names the RL step. The faults: the sampler's load skips one tensor, one
bucket is corrupted on its way, a whole sync is skipped. With ``rollout.verify_sync: false`` the
same faults pass unnoticed (the check is what catches them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unirl.core.config.run_config import load_config
from unirl.core.weight_sync import WeightSync
from unirl.core.weights.fingerprint import SyncVerificationError
from unirl.core.weights.stream import bucketed
from unirl.rollouts import build_rollout_source
from unirl.rollouts.sampler import Sampler

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"


def _source(tmp_path, verify: bool = True):
    cfg = load_config(
        EXAMPLE,
        [f"logging.run_dir={tmp_path / 'run'}", f"rollout.verify_sync={str(verify).lower()}"],
    )
    return cfg, build_rollout_source(cfg)


def _weights(source, shift: float) -> dict[str, torch.Tensor]:
    """New weights (every tensor moved): what an optimizer step would send."""
    return {k: v.detach() + shift for k, v in source.sampler.model.state_dict().items()}


def _stream(weights):
    return bucketed(weights.items(), 64 * 1024)  # several buckets


def test_a_full_sync_passes_and_is_timed(tmp_path):
    _, source = _source(tmp_path)
    source.sync_weights(_stream(_weights(source, 0.01)), policy_version=1)
    assert source.rollout_metrics()["time/verify_s"] > 0


def _skip_one_tensor(monkeypatch, name: str) -> None:
    load = Sampler._load_part

    def partial(self, part, own, loaded, unexpected):
        load(self, {k: v for k, v in part.items() if k != name}, own, loaded, unexpected)
        if name in part:
            loaded.add(name)  # the loader believes it took it

    monkeypatch.setattr(Sampler, "_load_part", partial)


@pytest.mark.parametrize("verify", [True, False])
def test_a_load_that_skips_one_tensor_is_caught(tmp_path, monkeypatch, verify):
    _, source = _source(tmp_path, verify)
    _skip_one_tensor(monkeypatch, "model.layers.1.mlp.down_proj.weight")
    stream = _stream(_weights(source, 0.01))
    if not verify:  # without the check the run would go on with a stale layer
        source.sync_weights(stream, policy_version=3)
        return
    with pytest.raises(SyncVerificationError, match=r"policy version 3.*layer 1 holds other"):
        source.sync_weights(stream, policy_version=3)


def test_a_corrupted_bucket_is_caught(tmp_path):
    _, source = _source(tmp_path)

    load = Sampler.load_buckets
    source.sampler.load_buckets = lambda buckets: load(  # type: ignore[method-assign]
        source.sampler, _alter_third(buckets)
    )
    with pytest.raises(SyncVerificationError, match="policy version 2") as e:
        source.sync_weights(_stream(_weights(source, 0.01)), policy_version=2)
    assert e.value.layer == _alter_third.layer


def _alter_third(buckets):
    """The buckets as they reach the sampler, the third one's last tensor altered in transit."""
    for k, bucket in enumerate(buckets):
        if k == 2:
            name, t = bucket[-1]
            t = t.clone()
            t.view(-1)[0] += 0.5
            bucket = [*bucket[:-1], (name, t)]
            _alter_third.layer = (
                "layer " + name.split(".layers.")[1].split(".")[0] if ".layers." in name else name
            )
        yield bucket


def test_a_skipped_sync_is_caught_and_the_loop_names_the_step(tmp_path, monkeypatch):
    cfg, source = _source(tmp_path)
    monkeypatch.setattr(Sampler, "load_buckets", lambda self, buckets: None)  # nothing loaded

    class Backend:  # the policy's stream, as a backend hands it out
        def stream_weights(self, bucket_bytes, dst=None):
            return _stream(_weights(source, 0.01))

    class Guard:
        def after_step(self, rl_step, metrics, bad):
            assert bad is None

    sync = WeightSync(cfg, Backend(), source)
    with pytest.raises(SyncVerificationError, match=r"after RL step 5: .*policy version 7") as e:
        sync.after_step(5, {}, Guard(), 7)
    assert e.value.layer == "layer 0"


# `unirl train` with the sampler's load skipping one tensor from the second sync on: the run stops
# in that step with one `unirl: error:` line naming the layer, the version and the RL step.
_JOB = """
import sys
from unirl.rollouts.sampler import Sampler
load, calls = Sampler._load_part, []
def partial(self, part, own, loaded, unexpected):
    skip = "model.layers.0.self_attn.o_proj.weight"
    calls.append(skip in part)
    if sum(calls) > 1 and skip in part:  # past the initial sync: drop one tensor
        part = {k: v for k, v in part.items() if k != skip}
        loaded.add(skip)
    load(self, part, own, loaded, unexpected)
Sampler._load_part = partial
from unirl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_unirl_train_stops_in_the_step_with_one_error_line(tmp_path):
    import subprocess
    import sys

    sets = [f"logging.run_dir={tmp_path / 'run'}", "train.rl_steps=3", "progress.enabled=false",
            "logging.tensorboard=false", "batch.prompts_per_rollout=4",
            "batch.samples_per_optimizer_step=32", "checkpoint.export_hf=false"]  # fmt: skip
    cmd = [sys.executable, "-c", _JOB, "train", str(EXAMPLE)]
    for s in sets:
        cmd += ["--set", s]
    root = Path(__file__).parents[2]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root,
                          env={**__import__("os").environ, "PYTHONPATH": str(root)})  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("unirl: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert "after RL step 1: " in errors[0] and "policy version 1" in errors[0], errors[0]
    assert "layer 0 holds other weights" in errors[0], errors[0]
