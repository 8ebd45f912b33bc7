"""The generating sources' base (`unirl.rollouts.generating`) and the engine-neutral serving code
(`unirl.rollouts.serving`): a second engine reuses both as they are."""

import ast
import random
from pathlib import Path

import torch

import unirl.rollouts.serving as serving
from unirl.rollouts.data.tasks import make_task
from unirl.rollouts.environments.episodes import EpisodeLimits
from unirl.rollouts.generating import GeneratingSource
from unirl.rollouts.sampler import Generation
from unirl.rollouts.sampler_source import SamplerRolloutSource
from unirl.rollouts.serving.engine import EngineSample
from unirl.rollouts.serving.episodes import ServedEpisodes, turn_seed
from unirl.rollouts.vllm.source import VllmRolloutSource

SHARED = ("next_rollout", "build_batch", "score", "state_dict", "load_state_dict", "num_rollouts")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_serving_imports_no_engine():
    """An SGLang plug-in uses serving/ as is: nothing there imports vLLM or an engine folder."""
    for path in Path(serving.__file__).parent.glob("*.py"):
        engines = {
            n for n in _imports(path) if n.split(".")[0] in ("vllm", "sglang")
            or n.startswith(("unirl.rollouts.vllm", "unirl.rollouts.sglang"))
        }  # fmt: skip
        assert not engines, f"{path.name} imports {sorted(engines)}"


def test_both_sources_keep_the_skeleton_in_the_base():
    for cls in (SamplerRolloutSource, VllmRolloutSource):
        assert issubclass(cls, GeneratingSource)
        assert not set(SHARED) & set(vars(cls)), cls.__name__


class ScriptedSource(GeneratingSource):
    """Answers every prompt with its own first two tokens, log-prob -0.5 each."""

    source_name = "scripted"

    def _generate_rollout(self, rl_step, problems, progress):
        group = self.samples_per_prompt
        gens = [
            Generation(
                response_tokens=torch.tensor(p.prompt_tokens[:2], dtype=torch.long),
                logprobs=torch.full((2,), -0.5),
                finished=False,
            )
            for p in problems
            for _ in range(group)
        ]
        return self.build_batch(problems, gens, rl_step)

    def _score_once(self, problems, responses):
        return self.score(problems, responses)


def _source(seed=3):
    task = make_task("reverse_digits")
    return ScriptedSource(
        task, prompts_per_rollout=2, samples_per_prompt=3, seed=seed, vocab_size=64,
        policy_version=7,
    )  # fmt: skip


def test_the_base_draws_scores_and_numbers_groups_like_a_hand_written_loop():
    source, task = _source(), make_task("reverse_digits")
    rng = random.Random(3)  # the reference: the same seeded stream, drawn by hand
    for step in range(2):
        batch = source.next_rollout(step)
        problems = [task.sample_problem(rng) for _ in range(2)]
        assert [s.group_id for s in batch.samples] == [2 * step + i // 3 for i in range(6)]
        for i, s in enumerate(batch.samples):
            p = problems[i // 3]
            assert s.prompt_tokens.tolist() == list(p.prompt_tokens)
            assert s.response_tokens.tolist() == list(p.prompt_tokens[:2])
            assert s.reward == float(task.reward(p, list(p.prompt_tokens[:2])))
            assert s.policy_version == 7 and s.metadata["prompt"] == p.prompt_text


def test_the_base_resumes_the_stream():
    first = _source()
    first.next_rollout(0)
    resumed = _source(seed=99)
    resumed.load_state_dict(first.state_dict())
    a, b = first.next_rollout(1), resumed.next_rollout(1)
    assert [s.prompt_tokens.tolist() for s in a.samples] == [
        s.prompt_tokens.tolist() for s in b.samples
    ]
    assert [s.group_id for s in a.samples] == [s.group_id for s in b.samples] == [2, 2, 2, 3, 3, 3]


class OneTurn:
    """Ends every episode after the first turn, reward 1 (no observation)."""

    def reset(self, prompt, metadata):
        return None

    def step(self, turn):
        return None, 1.0, True


class FakeEngine:
    """A `TokenEngine` that is not vLLM: answers [5, 6] with log-probs -1, -2; records seeds."""

    def __init__(self):
        self.seeds = []

    def generate(self, requests, *, temperature=None, max_new_tokens=None):
        self.seeds += [r.seed for r in requests]
        return [EngineSample(response_tokens=(5, 6), logprobs=(-1.0, -2.0), finished=True)] * len(
            requests
        )


def test_served_episodes_play_on_any_token_engine():
    task, engine = make_task("reverse_digits"), FakeEngine()
    episodes = ServedEpisodes(
        task, OneTurn, EpisodeLimits(max_turns=2, max_tokens=16), max_model_len=64,
        vocab_size=64, seed=11,
    )  # fmt: skip
    problems = [task.sample_problem(random.Random(0))]
    batch = episodes.rollout(
        engine, problems, group=2, rollout=4, rl_step=4, first_group=8, policy_version=3
    )
    assert engine.seeds == [turn_seed(11, 4, 0, 0), turn_seed(11, 4, 1, 0)]
    for s in batch.samples:
        assert s.prompt_tokens.tolist() == list(problems[0].prompt_tokens)
        assert s.response_tokens.tolist() == [5, 6]
        assert s.rollout_logprobs.tolist() == [-1.0, -2.0]
        assert (s.reward, s.group_id, s.policy_version) == (1.0, 8, 3)
