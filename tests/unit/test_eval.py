"""The eval section (unirl/rollouts/eval/evaluator.py): pass@k against hand computations, the metrics of an
evaluation whose responses are set by the test, and, through `unirl train`, that the training run
is the same with and without evaluation (its rollouts, rewards, losses) and that a resumed run
logs the evaluations of the uninterrupted one."""

import json
from pathlib import Path

import pytest

from tests.tiny_models import TINY_LLAMA
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError
from unirl.rollouts.eval.metrics import eval_metrics, pass_at_k, reported_ks


def test_pass_at_k_by_hand():
    # 1 - C(n-c, k) / C(n, k), each written out
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10
    assert pass_at_k(8, 3, 2) == pytest.approx(1 - 10 / 28)  # C(5,2)=10, C(8,2)=28
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # k=1: c/n
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # k=n: any passes
    assert pass_at_k(4, 3, 2) == 1.0  # n-c=1 < k: every pair holds a pass
    assert reported_ks(1) == [1] and reported_ks(4) == [1, 2, 4] and reported_ks(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_eval_metrics_by_hand():
    # two prompts, 4 responses each: 1 pass, then 2 passes (0.5 is below the threshold 1.0)
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.0]
    m = eval_metrics(rewards, [1, 2, 3, 4, 5, 6, 7, 8], samples_per_prompt=4, threshold=1.0)
    assert m["eval/reward_mean"] == pytest.approx(3.5 / 8)
    assert m["eval/response_length_mean"] == pytest.approx(4.5)
    assert m["eval/prompts"] == 2.0
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["eval/pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)
    assert m["eval/pass@4"] == 1.0


TINY = {**TINY_LLAMA, "vocab_size": 32, "num_hidden_layers": 1}
TRAIN = [
    {"prompt": f"{a}+{b}=", "metadata": {"answer": a + b}}
    for a, b in [(1, 2), (3, 4), (2, 5), (4, 4)]
]
HELD_OUT = [
    {"prompt": f"{a}+{b}=", "metadata": {"answer": a + b}} for a, b in [(2, 1), (3, 3), (1, 4)]
]


def _write(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _data(tmp_path, run="run", rl_steps=4, eval_section=None, reward="math_answer", **more):
    return {
        "backend": "deepspeed",
        "model": {"hf_config": TINY, "max_seq_len": 16, "init_seed": 1, "dtype": "fp32"},
        "optimizer": {"lr": 1e-3},
        "batch": {"prompts_per_rollout": 2, "samples_per_prompt": 2,
                  "samples_per_optimizer_step": 4, "micro_batch_size": 4},
        "parallel": {"world_size": 1},
        "rollout": {"prompts": _write(tmp_path / "train.jsonl", TRAIN), "reward": reward,
                    "max_new_tokens": 3},
        "train": {"rl_steps": rl_steps, "seed": 2},
        "logging": {"run_dir": str(tmp_path / run), "tensorboard": False},
        "checkpoint": {"export_hf": False, **more.get("checkpoint", {})},
        "progress": {"enabled": False},
        **({"eval": eval_section} if eval_section else {}),
    }  # fmt: skip


class _SetResponses:
    """An engine whose response to sample i is ``texts[i]`` (tokenized), recording its calls."""

    def __init__(self, task, texts):
        self.task, self.texts, self.calls = task, texts, []

    def generate_eval(self, prompts, *, temperature, max_new_tokens, seed):
        start = sum(len(c[0]) for c in self.calls)
        self.calls.append((list(prompts), temperature, max_new_tokens, seed))
        hf = self.task.tokenizer.hf
        return [
            (hf.encode(t, add_special_tokens=False), True)
            for t in self.texts[start : start + len(prompts)]
        ]


def test_an_evaluation_of_set_responses(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")
    from unirl.rollouts.build import build_task
    from unirl.rollouts.eval.evaluator import Evaluator

    held = _write(tmp_path / "held.jsonl", HELD_OUT)
    cfg = config_from_dict(_data(tmp_path, eval_section={"prompts": held, "samples_per_prompt": 2,
                                                          "temperature": 0.5, "every": 2}))  # fmt: skip
    # answers 3, 6, 5: prompt 0 right once, prompt 1 never, prompt 2 twice
    engine = _SetResponses(build_task(cfg), ["3", "1", "2", "4", "5", "5"])
    ev = Evaluator(cfg, engine)
    assert [ev.due(s, 5) for s in range(1, 6)] == [False, True, False, True, True]
    m = ev.run(2)
    assert m["eval/reward_mean"] == pytest.approx(3 / 6)
    assert m["eval/pass@1"] == pytest.approx((1 / 2 + 0 + 1) / 3)
    assert m["eval/pass@2"] == pytest.approx(2 / 3)
    # chunks of batch.prompts_per_rollout=2 prompts x 2 samples, the eval's own settings and
    # seeds (one per chunk), the rollout's budget
    assert [len(c[0]) for c in engine.calls] == [4, 2]
    assert {(c[1], c[2]) for c in engine.calls} == {(0.5, 3)}
    assert len({c[3] for c in engine.calls}) == 2


def test_eval_config_rules(tmp_path):
    held = str(tmp_path / "held.jsonl")
    data = _data(tmp_path, eval_section={"prompts": held})
    data["rollout"] = {"task": "reverse_digits"}
    with pytest.raises(ConfigError, match=r"eval: reads its prompts as rollout.prompts"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match=r"eval.reward_options"):
        config_from_dict(
            _data(tmp_path, eval_section={"prompts": held, "reward_options": {"a": 1}})
        )
    from unirl.core.config.paths import check_local_paths

    with pytest.raises(ConfigError, match=r"eval.prompts=.*held.jsonl' does not exist"):
        check_local_paths(config_from_dict(_data(tmp_path, eval_section={"prompts": held})))
    with pytest.raises(ConfigError, match=r"train.max_staleness"):
        d = _data(tmp_path, eval_section={"prompts": held})
        d["train"]["max_staleness"] = 1
        config_from_dict(d)


def _train_rows(rows):
    """The training records, without wall-clock times and rates."""
    timed = ("time/", "throughput/")
    return [{k: v for k, v in r.items() if not k.startswith(timed)} for r in rows if "loss" in r]


def _eval_rows(rows):
    return [
        {k: v for k, v in r.items() if k != "time/eval_s"} for r in rows if "eval/reward_mean" in r
    ]


def test_training_with_eval_is_training_without_and_resumes(tmp_path):
    pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
    from unirl.core.run.metrics_log import read_metrics
    from unirl.train import train

    held = _write(tmp_path / "held.jsonl", HELD_OUT)
    # the eval scores with math_answer; training with the response length, a signal at every
    # step, so the weights change at every step
    section = {"prompts": held, "every": 2, "samples_per_prompt": 2, "reward": "math_answer"}
    length = "tests.unit.custom_rewards:length_reward"
    train(config_from_dict(_data(tmp_path, run="off", reward=length)))
    train(config_from_dict(_data(tmp_path, run="on", eval_section=section, reward=length)))
    off = read_metrics(tmp_path / "off" / "metrics.jsonl")
    on = read_metrics(tmp_path / "on" / "metrics.jsonl")
    assert len(_train_rows(off)) == 4 and _train_rows(on) == _train_rows(off)
    assert all(r["grad_norm"] > 0 for r in _train_rows(off))  # every step moved the weights
    evals = _eval_rows(on)
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["eval/prompts"] == 3.0 and 0.0 <= r["eval/pass@1"] <= r["eval/pass@2"] <= 1.0
    # stopped after step 2 (its checkpoint), resumed to step 4: the same evaluations
    train(config_from_dict(_data(tmp_path, run="resumed", rl_steps=2, eval_section=section,
                                 reward=length, checkpoint={"every": 2})))  # fmt: skip
    train(config_from_dict(_data(tmp_path, run="resumed", eval_section=section, reward=length,
                                 checkpoint={"every": 2})), resume=True)  # fmt: skip
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert _eval_rows(resumed) == evals and _train_rows(resumed) == _train_rows(off)


class _RecordingEngine:
    """Stands in for the vLLM engine (its own tests start vLLM): every response is token 5
    then the stop token; each call's requests and sampling overrides are recorded."""

    def __init__(self, eos_id):
        self.eos_id, self.calls = eos_id, []

    def generate(self, requests, **overrides):
        from unirl.rollouts.serving.engine import EngineSample

        self.calls.append((list(requests), overrides))
        return [
            EngineSample(response_tokens=(5, self.eos_id), logprobs=(-0.5, -0.5), finished=True)
            for _ in requests
        ]


def test_the_vllm_source_scores_a_rollout_in_one_call_and_evaluates_with_its_engine(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")
    from unirl.rollouts.build import build_task
    from unirl.rollouts.eval.evaluator import Evaluator
    from unirl.rollouts.vllm import VllmRolloutSource
    from unirl.rollouts.vllm.sleep import SleepCycle

    log = tmp_path / "calls.txt"
    data = _data(tmp_path, reward="tests.unit.worker_rewards:counted_length",
                 eval_section={"prompts": _write(tmp_path / "held.jsonl", HELD_OUT),
                               "samples_per_prompt": 2, "max_new_tokens": 2, "temperature": 0.7})  # fmt: skip
    data["rollout"] |= {"source": "vllm", "reward_options": {"log": str(log)}}
    cfg = config_from_dict(data)
    task = build_task(cfg)
    source = VllmRolloutSource(task, cfg, hf_config=None, vocab_size=32, seed=cfg.train.seed)
    source._engine = engine = _RecordingEngine(task.tokenizer.eos_id)
    source._sleep = SleepCycle(None, "off")  # what the engine's start sets up
    for k in range(2):
        batch = source.next_rollout(k)
        # the response "5 <eos>" decodes to one character
        assert [s.reward for s in batch.samples] == [1.0] * 4
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["4", "4"]
    m = Evaluator(cfg, source).run(3)  # the eval's reward is the rollouts' (no eval.reward)
    assert m["eval/reward_mean"] == 1.0 and m["eval/response_length_mean"] == 2.0
    (rollout_1, none), *_, (last, overrides) = engine.calls
    assert none == {} and overrides == {"temperature": 0.7, "max_new_tokens": 2}
    assert len(last) == 2  # the third prompt's 2 samples: chunks of prompts_per_rollout
    seeds = [r.seed for _, (reqs, o) in enumerate(engine.calls) if o for r in reqs]
    assert len(set(seeds)) == len(seeds) == 6  # one seed per sample
    assert not {r.seed for r in rollout_1} & set(seeds)


def test_unirl_plot_draws_the_eval_beside_the_training_reward(tmp_path):
    from unirl.plot import panel_lines, plot_run

    rows = [{"step": s, "reward/mean": 0.1 * s, "loss": 1.0} for s in (1, 2, 3, 4)]
    rows += [{"step": s, "eval/reward_mean": 0.2, "eval/pass@1": 0.2, "eval/pass@2": 0.3,
              "eval/pass@10": 0.5} for s in (2, 4)]  # fmt: skip
    assert panel_lines(rows) == [
        ("reward (mean)", [("reward/mean", "train"), ("eval/reward_mean", "eval (held-out)")]),
        ("eval pass@k (held-out)",
         [("eval/pass@1", "pass@1"), ("eval/pass@2", "pass@2"), ("eval/pass@10", "pass@10")]),
        ("loss", [("loss", None)]),
    ]  # fmt: skip
    assert panel_lines(rows[:4])[0] == ("reward (mean)", [("reward/mean", None)])
    pytest.importorskip(
        "matplotlib", reason="unirl plot needs matplotlib (pip install unirl[plot])"
    )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run(tmp_path).stat().st_size > 0
