"""Multi-turn episodes, token in and token out (`unirl.rollouts.environments.episodes`): the sample holds the
engine's sampled ids and the observations' ids, never a re-tokenisation; masks, log-probs,
rewards, limits, metrics and environment failures against hand-built expectations."""

import random
import time

import pytest
import torch

from tests.tiny_models import tiny_llama
from unirl.core.data.rollout import RolloutBatch
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.core.step import _batch_metrics
from unirl.rollouts.data.tasks import make_task
from unirl.rollouts.environments import Observation, make_environment
from unirl.rollouts.environments.episodes import EpisodeLimits, EpisodeRunner
from unirl.rollouts.sampler import Generation
from unirl.rollouts.sampler_source import SamplerRolloutSource

VOCAB = 20


# A tokenizer whose decode + encode is not the identity: ids 7 and 8 both read "a", and "aa"
# encodes as the single id 9. Re-tokenising the conversation would change the policy's ids.
def decode(ids):
    text = {7: "a", 8: "a", 9: "aa", 10: "b", 11: "c", 12: "="}
    return "".join(text.get(int(t), "") for t in ids)


def encode(text):
    out, i = [], 0
    while i < len(text):
        if text.startswith("aa", i):
            out.append(9)
            i += 2
        else:
            out.append({"a": 7, "b": 10, "c": 11, "=": 12}[text[i]])
            i += 1
    return out


class ScriptedEngine:
    """Answers each call with the next turn of a per-row script; records the token prompts."""

    def __init__(self, script):
        self.script = script  # list (per episode) of list (per turn) of (ids, logprobs)
        self.prompts = []
        self.keys = []
        self.calls = 0

    def __call__(self, prompts, progress, keys):
        self.prompts.append([list(p) for p in prompts])
        self.keys.append(list(keys))
        out = []
        for p in prompts:
            row = self.row_of[tuple(p[: self.prompt_len])]
            turn = len(self.turn_counter.setdefault(row, []))
            self.turn_counter[row].append(None)
            ids, lps = self.script[row][turn]
            out.append(
                Generation(
                    response_tokens=torch.tensor(ids), logprobs=torch.tensor(lps), finished=True
                )
            )
        return out

    def bind(self, prompts):
        self.prompt_len = len(prompts[0])
        self.row_of = {tuple(p): i for i, p in enumerate(prompts)}
        self.turn_counter = {}


class EchoTool:
    """Answers a turn ending with "c" with the text "=bb" (a tool call); any other turn ends the
    episode with reward 1 when it reads "aab", else 0.25; every turn's text is recorded."""

    def __init__(self, as_ids=False):
        self.as_ids, self.seen = as_ids, []

    def reset(self, prompt, metadata):
        return None

    def step(self, turn):
        self.seen.append(turn)
        if turn.text.endswith("c"):
            return ([12, 10, 10] if self.as_ids else "=bb"), 0.5, False
        return None, (1.0 if turn.text == "aab" else 0.25), True


def runner(engine, **limits):
    limits = {"max_turns": 4, "max_tokens": 64, "step_timeout_s": 5.0} | limits
    return EpisodeRunner(
        engine,
        encode=encode,
        decode=decode,
        limits=EpisodeLimits(**limits),
        max_seq_len=64,
        vocab_size=VOCAB,
    )


def play(script, env_factory, prompts, **limits):
    engine = ScriptedEngine(script)
    engine.bind(prompts)
    r = runner(engine, **limits)
    envs = [env_factory() for _ in prompts]
    eps = [
        r.start(e, p, "q", {}, f"episode {i}", index=i)
        for i, (e, p) in enumerate(zip(envs, prompts))
    ]
    r.run(eps)
    return eps, envs, engine


TURN0 = ([7, 8, 11], [-0.1, -0.2, -0.3])  # "aac": decode+encode gives [9, 11], not these ids
TURN1 = ([8, 7, 10, 2], [-0.4, -0.5, -0.6, -0.7])  # "aab" then <eos> (id 2 reads "")


def test_token_in_token_out_against_a_hand_built_sample():
    prompts = [[1, 3, 4], [1, 5, 6]]
    script = [[TURN0, TURN1], [([10, 2], [-1.0, -2.0])]]  # episode 1 answers at once
    eps, envs, engine = play(script, EchoTool, prompts)
    assert encode(decode(TURN0[0])) != TURN0[0]  # re-tokenising would fail this test
    ep = eps[0]
    obs = encode("=bb")
    assert ep.response == TURN0[0] + obs + TURN1[0]
    assert ep.mask == [True] * 3 + [False] * 3 + [True] * 4
    assert ep.logprobs == pytest.approx(TURN0[1] + [0.0] * 3 + TURN1[1])
    assert ep.turn_rewards == [0.5, 1.0] and ep.reward == 1.5
    assert ep.turn_ends == [2, 9]
    assert (ep.turns, ep.tool_calls, ep.truncated) == (2, 1, False)
    # token in: the second turn was generated from the prompt and the earlier ids, as ids
    assert engine.prompts[1] == [prompts[0] + TURN0[0] + obs]
    # the environment saw the engine's ids and their text
    assert [t.token_ids for t in envs[0].seen] == [tuple(TURN0[0]), tuple(TURN1[0])]
    assert envs[0].seen[1].text == "aab" and envs[0].seen[1].index == 1
    # the other episode ended after one turn: episodes of different lengths in one rollout
    assert eps[1].response == [10, 2] and eps[1].mask == [True, True] and eps[1].reward == 0.25
    fields = ep.sample_fields()
    assert fields["loss_mask"].tolist() == ep.mask
    assert fields["rollout_logprobs"].tolist() == pytest.approx(ep.logprobs)
    # each turn's reward on its last token (response index 2: "c", 9: <eos>), zeros elsewhere
    assert fields["token_rewards"].tolist() == [0, 0, 0.5, 0, 0, 0, 0, 0, 0, 1.0]
    assert eps[1].sample_fields()["token_rewards"].tolist() == [0.0, 0.25]
    # the engine was told which episode and turn each prompt is (its per-request seeds)
    assert engine.keys == [[(0, 0), (1, 0)], [(0, 1)]]


def test_observation_as_token_ids_is_appended_as_is():
    eps, _, _ = play([[TURN0, TURN1]], lambda: EchoTool(as_ids=True), [[1, 3]])
    assert eps[0].response[3:6] == [12, 10, 10]


def test_max_turns_truncates_and_counts():
    call = ([11], [-0.3])
    eps, _, _ = play([[call, call, call]], EchoTool, [[1, 3]], max_turns=2)
    ep = eps[0]
    assert (ep.turns, ep.tool_calls, ep.truncated) == (2, 1, True)
    assert ep.response == [11, *encode("=bb"), 11]
    assert ep.mask == [True, False, False, False, True]


def test_max_episode_tokens_cuts_with_the_mask_right():
    # 3 policy tokens + 3 observation tokens, then a 4-token turn cut to 2 under a limit of 8
    eps, envs, _ = play([[TURN0, TURN1]], EchoTool, [[1, 3]], max_tokens=8)
    ep = eps[0]
    assert ep.response == TURN0[0] + encode("=bb") + TURN1[0][:2]
    assert ep.mask == [True] * 3 + [False] * 3 + [True] * 2
    assert ep.logprobs == pytest.approx(TURN0[1] + [0.0] * 3 + TURN1[1][:2])
    assert ep.truncated and len(envs[0].seen) == 1  # the cut turn never reached the environment
    assert ep.reward == 0.5


class Raising(EchoTool):
    def step(self, turn):
        if turn.index == 1:
            raise KeyError("boom")
        return super().step(turn)


class Hanging(EchoTool):
    def step(self, turn):
        time.sleep(30)


def test_environment_error_names_episode_and_turn():
    with pytest.raises(RolloutDataError, match=r"episode 0, turn 1: .*KeyError.*boom"):
        play([[TURN0, TURN1]], Raising, [[1, 3]])


def test_environment_error_with_failure_reward():
    eps, _, _ = play([[TURN0, TURN1]], Raising, [[1, 3]], failure_reward=-1.0)
    assert eps[0].reward == -1.0 and eps[0].metadata()["env_failed"]
    assert "boom" in eps[0].metadata()["env_error"]
    # no turn's reward counts: the failure reward is the outcome, at the last token
    assert not eps[0].sample_fields()["token_rewards"].any()


def test_hanging_environment_times_out():
    t0 = time.monotonic()
    with pytest.raises(RolloutDataError, match=r"episode 0, turn 0: .*env_step_timeout_s=0.2"):
        play([[TURN0]], Hanging, [[1, 3]], step_timeout_s=0.2)
    assert time.monotonic() - t0 < 5


def test_malformed_step_result_is_named():
    class Bad(EchoTool):
        def step(self, turn):
            return "x"

    with pytest.raises(RolloutDataError, match=r"turn 0: .*not \(observation, reward, done\)"):
        play([[TURN0]], Bad, [[1, 3]])


def test_observation_type():
    with pytest.raises(ConfigError, match="exactly one"):
        Observation()


def test_episode_metrics():
    eps, _, _ = play([[TURN0, TURN1], [([10, 2], [-1.0, -2.0])]], EchoTool, [[1, 3], [1, 4]])
    from unirl.core.data.rollout import RolloutSample

    batch = RolloutBatch(
        tuple(
            RolloutSample(**e.sample_fields(), group_id=0, metadata={"episode": e.metadata()})
            for e in eps
        )
    )
    m = _batch_metrics(batch)
    assert m["episode/turns"] == 1.5 and m["episode/tool_calls"] == 0.5
    assert m["episode/truncated"] == 0.0 and m["reward/mean"] == pytest.approx(0.875)


# -- the sampler source runs episodes with a real model ---------------------------------------


def test_sampler_source_episodes_are_the_engines_ids_and_logprobs():
    torch.set_num_threads(1)
    task = make_task("tool_lookup")
    model = tiny_llama(task.tokenizer.vocab_size)
    from unirl.rollouts.environments.registry import environment_factory

    source = SamplerRolloutSource(
        task,
        model,
        prompts_per_rollout=4,
        samples_per_prompt=4,
        temperature=1.0,
        top_p=1.0,
        max_new_tokens=4,
        seed=3,
        verify_sync=True,
        stop=("c",),
        environment=environment_factory("hidden_number"),
        episode_limits=EpisodeLimits(max_turns=3, max_tokens=16),
        max_seq_len=24,
    )
    turns = []
    generate = source.sampler.generate
    source.sampler.generate = lambda prompts, progress=None: (
        turns.append((list(map(list, prompts)), r := generate(prompts, progress=progress))) or r
    )
    batch = source.next_rollout(0)
    batch.validate(vocab_size=task.tokenizer.vocab_size, max_seq_len=24, samples_per_prompt=4)
    # The engine's calls hold the episodes still going, in order: episode i is row
    # (episodes before it with more than k turns) of call k. Every policy token is one the
    # engine sampled, at the place it sampled it, and its token prompt was the episode so far.
    n_turns = [s.metadata["episode"]["turns"] for s in batch.samples]
    multi = 0
    for i, s in enumerate(batch.samples):
        ids, mask = s.prompt_tokens.tolist(), s.loss_mask.tolist()
        full = ids + s.response_tokens.tolist()
        p, j = len(ids), 0
        for k in range(n_turns[i]):
            row = sum(1 for t in n_turns[:i] if t > k)
            prompt, gen = turns[k][0][row], turns[k][1][row]
            assert prompt == full[: p + j]
            n = min(gen.response_tokens.numel(), s.response_length - j)
            assert full[p + j : p + j + n] == gen.response_tokens.tolist()[:n]
            assert mask[j : j + n] == [True] * n
            torch.testing.assert_close(s.rollout_logprobs[j : j + n], gen.logprobs[:n])
            j += n
            while j < s.response_length and not mask[j]:  # the observation
                multi += 1
                j += 1
        assert j == s.response_length
        # rollout log-probs of policy tokens: a full-sequence forward (fp32), not the sampler
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([full])).logits[0].float(), -1)
        want = torch.stack([logp[p - 1 + k, full[p + k]] for k in range(s.response_length)])
        m = s.loss_mask
        torch.testing.assert_close(s.rollout_logprobs[m], want[m], atol=1e-5, rtol=0)
        assert bool((s.rollout_logprobs[~m] == 0).all())
        ep = s.metadata["episode"]
        assert ep["turns"] == ep["tool_calls"] + 1 or ep["truncated"] or ep["env_failed"]
    assert multi > 0, "no episode called the tool; pick another seed"


def test_hidden_number_environment():
    from unirl.rollouts.environments.base import Turn

    env = make_environment("hidden_number")
    env.reset("?", {"secret": "7"})
    call = Turn(token_ids=(), text="c", index=0, finished=True)
    assert env.step(call) == ("=7", 0.2, False)
    assert env.step(call) == ("=7", 0.0, False)  # only the first call earns
    assert env.step(Turn(token_ids=(), text="7", index=1, finished=True)) == (None, 0.8, True)
    assert env.step(Turn(token_ids=(), text="77", index=1, finished=True))[1] == 0.0
    with pytest.raises(ConfigError, match="secret"):
        env.reset("?", {})
    problem = make_task("tool_lookup").sample_problem(random.Random(0))
    assert problem.metadata["secret"] == problem.target_text


# -- config ----------------------------------------------------------------------------------


def _example(**rollout):
    import yaml

    from unirl.core.config.run_config import config_from_dict

    with open("examples/tiny_multiturn.yaml") as f:
        data = yaml.safe_load(f)
    data["rollout"].update(rollout)
    return config_from_dict(data)


def test_config_environment_rules():
    cfg = _example()
    assert cfg.rollout.environment == "hidden_number" and cfg.rollout.max_turns == 3
    with pytest.raises(ConfigError, match=r"rollout\.source: file does not run multi-turn"):
        _example(source="file", file="rollouts.jsonl", stop=[])
    assert _example(source="vllm").rollout.source == "vllm"  # vLLM runs episodes
    with pytest.raises(ConfigError, match=r"rollout.max_turns=3 applies to multi-turn"):
        _example(environment=None, env_step_timeout_s=60.0, max_episode_tokens=None)
    with pytest.raises(ConfigError, match=r"max_episode_tokens=2 is below"):
        _example(max_episode_tokens=2)
    with pytest.raises(ConfigError, match=r"not a registered environment"):
        from unirl.rollouts.build import build_sampler_source

        build_sampler_source(_example(environment="hidden_nmber"))


# -- the loss of a multi-turn batch -------------------------------------------------------------


def test_multi_turn_loss_and_grads_equal_a_per_turn_loop():
    """unirl's ppo_clip token-mean loss on padded multi-turn episodes (mask holes at the
    observations) against a loop over turns: each turn scored by its own forward of the
    episode up to that turn, the clipped term summed over policy tokens, / their count."""
    from unirl.core.maths.losses.settings import LossSettings
    from unirl.losses import policy_loss

    torch.manual_seed(0)
    model = tiny_llama(VOCAB).train()
    eps, _, _ = play(
        [[TURN0, TURN1], [([10, 2], [-1.0, -2.0])], [([11], [-0.3]), ([7, 2], [-0.2, -0.1])]],
        EchoTool,
        [[1, 3, 4], [1, 5, 6], [1, 4, 4]],
    )
    adv = torch.tensor([0.7, -1.2, 0.4])
    settings = LossSettings(clip_low=0.2, clip_high=0.28)
    # old log-probs: the rollout's shifted per token, so some ratios clip
    olds = [torch.tensor(e.logprobs) + 0.3 * torch.randn(len(e.logprobs)) for e in eps]

    # unirl: one forward per episode, padded to [B, L]
    width = max(len(e.response) for e in eps)
    old = torch.zeros(len(eps), width)
    mask = torch.zeros(len(eps), width, dtype=torch.bool)
    rows = []
    for b, e in enumerate(eps):
        full = torch.tensor([e.prompt + e.response])
        lp = torch.log_softmax(model(input_ids=full).logits[0].float(), -1)
        p, n = len(e.prompt), len(e.response)
        rows.append(lp[torch.arange(p - 1, p + n - 1), torch.tensor(e.response)])
        old[b, :n] = olds[b]
        mask[b, :n] = torch.tensor(e.mask)
    logp = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    loss, _ = policy_loss("ppo_clip", logp, old, adv, mask, settings=settings)
    grads = torch.autograd.grad(loss, list(model.parameters()))

    # the reference: a Python loop over episodes and turns
    total, count = 0.0, 0
    for b, e in enumerate(eps):
        start = 0
        for end in e.turn_ends:
            # the turn's policy tokens: from the first unmasked token after the last observation
            span = [j for j in range(start, end + 1) if e.mask[j]]
            prefix = torch.tensor([e.prompt + e.response[: end + 1]])
            lp = torch.log_softmax(model(input_ids=prefix).logits[0].float(), -1)
            for j in span:
                new = lp[len(e.prompt) + j - 1, e.response[j]]
                ratio = torch.exp(new - olds[b][j])
                clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
                total = total + torch.maximum(-adv[b] * ratio, -adv[b] * clipped)
                count += 1
            start = end + 1
    want = total / count
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    assert count == sum(sum(e.mask) for e in eps)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-4)


def test_readme_environment_snippet():
    """The example environment of docs/guides/multi-turn.md, run as written, through the episode loop."""
    from tests.unit.doc_snippets import doc_snippet
    from unirl.rollouts.environments import ENVIRONMENTS

    namespace: dict = {}
    try:
        exec(doc_snippet("guides/multi-turn.md", "environment"), namespace)
        env = make_environment("calculator")
        env.reset("?", {"answer": "84"})
        from unirl.rollouts.environments import Turn

        ask = Turn(token_ids=(1,), text="12*7=", index=0, finished=True)
        assert env.step(ask) == ("84", 0.0, False)
        assert env.step(Turn(token_ids=(2,), text="84", index=1, finished=True))[1:] == (1.0, True)
    finally:
        ENVIRONMENTS.unregister("calculator")


def test_overlong_penalty_on_an_episode_against_its_token_budget():
    """DAPO's penalty for episodes: the response (turns and observations) against the episode's
    budget. Limit 8, buffer 4: free up to 4 tokens. Episode 0 is cut at 8 tokens (full penalty
    -0.5 at factor 0.5); episode 1 answers in 2 tokens (none). Hand-computed."""
    from unirl.core.config.sections.rollout_shaping import OverlongConfig
    from unirl.rollouts.data.tasks import Problem
    from unirl.rollouts.environments.episode_batch import episode_rollout

    prompts = [[1, 3, 4], [1, 5, 6]]
    engine = ScriptedEngine([[TURN0, TURN1], [([10, 2], [-1.0, -2.0])]])
    engine.bind(prompts)
    problems = [Problem(prompt_tokens=p, prompt_text="q", target_text="") for p in prompts]
    batch = episode_rollout(
        runner(engine, max_tokens=8), EchoTool, problems, group=1, rl_step=0, first_group=0,
        task_name="t", decode=decode, policy_version=0,
        overlong=OverlongConfig(buffer_tokens=4, penalty_factor=0.5),
    )  # fmt: skip
    cut, short = batch.samples
    assert len(cut.response_tokens) == 8 and not cut.metadata["finished"]
    assert cut.metadata["task_reward"] == 0.5 and cut.metadata["overlong_penalty"] == -0.5
    assert cut.reward == pytest.approx(0.0)
    # the per-turn token rewards still sum to the reward: the penalty sits on the last token
    assert cut.token_rewards.tolist() == [0, 0, 0.5, 0, 0, 0, 0, -0.5]
    assert short.metadata["overlong_penalty"] == 0.0 and short.reward == 0.25
    from unirl.rollouts.shaping.settings import shaping_summary

    cfg = _example(overlong={"buffer_tokens": 2}, max_episode_tokens=12)
    assert (
        "2 tokens short of the episode's budget (12 response tokens"
        in (shaping_summary(cfg)["overlong_penalty"])
    )
    with pytest.raises(ConfigError, match=r"longer than rollout.max_episode_tokens=6"):
        _example(overlong={"buffer_tokens": 7}, max_episode_tokens=6)


def test_environment_episodes_take_their_tasks_from_a_prompt_dataset(tmp_path):
    """rollout.environment with rollout.prompts: each episode's reset gets its row's prompt and
    metadata (here the hidden digit, from the file), the environment scores it, and a
    rollout.reward beside it is refused (it would go unused)."""
    import json

    from unirl.rollouts.build import build_sampler_source

    rows = [{"prompt": "?", "metadata": {"secret": s, "chars": "0123456789=c?"}} for s in "386"]
    path = tmp_path / "secrets.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _example(prompts=str(path), task="reverse_digits")
    with pytest.raises(ConfigError, match=r"rollout.reward='exact_match' with rollout.environment"):
        _example(prompts=str(path), reward="exact_match")
    seen = []

    class Recording:
        def __init__(self):
            self.env = make_environment("hidden_number")

        def reset(self, prompt, metadata):
            seen.append((prompt, metadata["secret"]))
            return self.env.reset(prompt, metadata)

        def step(self, turn):
            return self.env.step(turn)

    source = build_sampler_source(cfg)
    source.environment = Recording
    batch = source.next_rollout(0)
    assert sorted({s for _, s in seen}) == ["3", "6", "8"] and {p for p, _ in seen} == {"?"}
    for sample in batch.samples:
        assert sample.metadata["prompt_metadata"]["secret"] in "386"
        assert not sample.metadata["episode"]["env_failed"]
