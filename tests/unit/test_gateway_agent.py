"""Agents written with the official ``openai`` SDK play episodes through the gateway on the
built-in sampler (a tiny Llama, fp32, a character tokenizer with a chat template written here):

- token in, token out: every trained span of a sample is, call by call, the prompt the engine
  was given and the ids it returned (recorded at the engine, below the gateway), with its
  log-probs, which equal a plain transformers fp32 forward of the sample; calls join one sample
  wherever the template re-renders the earlier completion as the same ids;
- a template that drops earlier reasoning makes every call fork, each fork exactly the engine's;
- crash, hang, late call and too many calls at once: each a named outcome, the other episodes
  of the rollout intact; without ``failure_reward`` a failed episode stops the run naming it;
- the endpoint: a wrong key, a late key, a body too large, a refused temperature, tool calls.
"""

from __future__ import annotations

import json
import string
import time
from typing import Any

import attrs
import httpx
import openai
import pytest
import torch
import yaml

from tests.unit import gateway_agents
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import RolloutDataError
from unirl.rollouts.gateway.assembly import assemble
from unirl.rollouts.gateway.source import build_agent_source
from unirl.rollouts.serving.engine import EngineSample

# every character the templates and the prompts use: the character tokenizer is built over them
ALPHABET = string.ascii_letters + string.digits + ' <>{}:"_,.=/?!\n'
KEEPS_HISTORY = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}A:{{ m.content or '' }}{{ eos_token }}"
    "{%- else -%}{{ m.role[0] | upper }}:{{ m.content }}\n{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}A:{%- endif -%}"
)
# as chat templates that strip earlier reasoning do: the model's turn opens with "<think>", and an
# earlier assistant message is rendered from its content alone (the reasoning gone)
DROPS_REASONING = KEEPS_HISTORY.replace(
    "{%- if add_generation_prompt -%}A:{%- endif -%}",
    "{%- if add_generation_prompt -%}A:<think>{%- endif -%}",
)
SPECIAL = {0, 1, 3}  # <pad> <bos> <sep>: skipped when a completion is decoded


def make_config(tmp_path, *, agent, template, prompts, group=2, extra=None, **options):
    """The tiny example's model and trainer, a prompt file whose metadata carries every
    character (the character tokenizer's alphabet), ``template`` as the chat template."""
    with open("examples/tiny_agent.yaml") as f:
        data = yaml.safe_load(f)
    lines = [{"prompt": p, "metadata": {"answer": "7", "chars": ALPHABET}} for p in prompts]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "chat.jinja").write_text(template)
    data["model"]["hf_config"].pop("vocab_size")  # the character tokenizer's
    data["model"]["hf_config"]["max_position_embeddings"] = 256
    data["model"]["max_seq_len"] = 128
    n = len(prompts) * group
    data["batch"] = {"prompts_per_rollout": len(prompts), "samples_per_prompt": group,
                     "samples_per_optimizer_step": n, "micro_batch_size": n}  # fmt: skip
    r = data["rollout"]
    del r["task"], r["stop"]
    r.update(prompts=str(tmp_path / "prompts.jsonl"), reward="exact_match", answer_key=None,
             max_new_tokens=8)  # fmt: skip
    r["agent"] = {"function": f"tests.unit.gateway_agents:{agent}",
                  "chat_template": str(tmp_path / "chat.jinja"), **options}  # fmt: skip
    data["logging"] = {"run_dir": str(tmp_path / "run")}
    data.update(extra or {})
    return config_from_dict(data)


class Recorded:
    """The engine below the gateway, recording every (prompt, sample) it returned; ``delay_s``
    holds each batch so that calls pile up."""

    def __init__(self, engine, delay_s=0.0):
        self.engine, self.delay_s, self.seen = engine, delay_s, []

    def generate(self, prompts, seeds, max_new_tokens):
        time.sleep(self.delay_s)
        out = self.engine.generate(prompts, seeds, max_new_tokens)
        self.seen += [(tuple(p), s) for p, s in zip(prompts, out)]
        return out


def spans(mask):
    """[(start, end)) of each run of trained tokens."""
    out, j = [], 0
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


def played(tmp_path, delay_s=0.0, **kwargs) -> Any:
    cfg = make_config(tmp_path, **kwargs)
    source = build_agent_source(cfg)
    source.engine = Recorded(source.engine, delay_s)
    return source


def test_tool_agent_samples_are_the_engines_tokens(tmp_path):
    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY,
                         prompts=["what is x?", "say 7"])  # fmt: skip
    try:
        batch = source.next_rollout(0)
    finally:
        source.close()
    batch.validate(vocab_size=source.vocab_size, max_seq_len=128, samples_per_prompt=2)
    engine: dict = {}  # prompt -> every sample the engine returned for it (episodes share one)
    for prompt, sample in source.engine.seen:
        engine.setdefault(prompt, []).append(sample)
    assert len(source.engine.seen) == 12  # 4 episodes x 3 calls
    model = source.inner.sampler.model
    joined = 0
    for s in batch.samples:
        agent = s.metadata["agent"]
        assert agent["outcome"] == "ok" and agent["calls"] == 3
        prompt, response = s.prompt_tokens.tolist(), s.response_tokens.tolist()
        full = prompt + response
        trained = spans(s.loss_mask.tolist())
        assert len(trained) == len(agent["call_ends"])  # the last fork's calls
        for a, b in trained:  # zero drift per call: the engine's prompt and its ids
            got = (tuple(response[a:b]), tuple(s.rollout_logprobs[a:b].tolist()))
            returned = engine[tuple(full[: len(prompt) + a])]
            assert got in [(x.response_tokens, tuple(x.logprobs)) for x in returned]
        assert bool((s.rollout_logprobs[~s.loss_mask] == 0).all())
        # the log-probs against a plain transformers fp32 forward of the whole sample
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0, len(prompt) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        m = s.loss_mask
        torch.testing.assert_close(s.rollout_logprobs[m].double(), ref[m], atol=1e-4, rtol=0)
        joined += agent["forks"] == 1
    # a call joins the one before exactly when the template re-renders that one's completion
    # as the same ids: no special token inside it (decoding skips those)
    seen = set(source.engine.seen)
    for episode in source.last_episodes:
        fork_of = {c.index: f for f, fork in enumerate(assemble(episode.calls)) for c in fork.calls}
        for before, call in zip(episode.calls, episode.calls[1:]):
            generated = [(p, x.response_tokens) for p, x in seen]
            assert (call.prompt_ids, call.completion_ids) in generated  # recorded as generated
            inner = (
                before.completion_ids[:-1]
                if before.completion_ids[-1] == 2
                else before.completion_ids
            )
            clean = not SPECIAL & set(inner)
            assert (fork_of[call.index] == fork_of[before.index]) == clean
    assert joined >= 1


def test_a_template_that_drops_reasoning_forks_every_call(tmp_path):
    source = played(tmp_path, agent="tool_agent", template=DROPS_REASONING,
                         prompts=["what is x?"])  # fmt: skip
    try:
        batch = source.next_rollout(0)
    finally:
        source.close()
    engine = dict(source.engine.seen)  # one episode per prompt here: prompts differ
    for s in batch.samples:
        assert s.metadata["agent"]["forks"] == 3  # no call extends the one before
        # the sample is the last fork: the third call's prompt and its completion, unchanged
        sample = engine[tuple(s.prompt_tokens.tolist())]
        assert tuple(s.response_tokens.tolist()) == sample.response_tokens
        assert s.loss_mask.all() and s.rollout_logprobs.tolist() == list(sample.logprobs)
    assert source.rollout_metrics()["gateway/dropped_calls"] == 4.0  # 2 episodes x 2 forks


FAULTS = ["ok", "crash", "hang", "late", "burst"]


def test_faults_are_named_per_episode(tmp_path):
    gateway_agents.LATE.clear()
    source = played(tmp_path, agent="fault_agent", template=KEEPS_HISTORY, prompts=FAULTS,
                         group=1, failure_reward=-1.0, episode_timeout_s=4.0,
                         max_calls_in_flight=2, delay_s=0.2)  # fmt: skip
    try:
        t0 = time.monotonic()
        batch = source.next_rollout(0)
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while "reply" not in gateway_agents.LATE and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        source.close()
    outcome = {s.metadata["prompt"]: s.metadata["agent"]["outcome"] for s in batch.samples}
    reward = {s.metadata["prompt"]: s.reward for s in batch.samples}
    assert outcome == {"ok": "ok", "crash": "crashed", "hang": "timeout", "late": "ok",
                       "burst": "too_many_calls_in_flight"}  # fmt: skip
    assert reward == {"ok": 0.5, "crash": -1.0, "hang": -1.0, "late": 0.5, "burst": -1.0}
    errors = {s.metadata["prompt"]: s.metadata["agent"].get("error") for s in batch.samples}
    assert "ValueError: the agent's tool broke" in errors["crash"]
    assert "episode_timeout_s=4" in errors["hang"]
    assert took < 4.0 + 3.0  # the hung agent is abandoned at its timeout
    # the late call is refused and counted, nothing recorded
    assert gateway_agents.LATE["reply"] == (410, "episode_ended")
    assert source.gateway.late_calls == 1
    for s in batch.samples:  # every sample still the engine's own tokens
        if s.metadata["agent"]["calls"]:
            assert s.loss_mask.any()


def test_a_failed_episode_stops_the_run_without_failure_reward(tmp_path):
    source = played(tmp_path, agent="fault_agent", template=KEEPS_HISTORY,
                         prompts=["ok", "crash"], group=1)  # fmt: skip
    try:
        with pytest.raises(RolloutDataError, match=r"episode \d \(group \d\): the agent's "
                           r"episode ended as crashed: ValueError: the agent's tool broke.*"
                           r"rollout.agent.failure_reward"):  # fmt: skip
            source.next_rollout(0)
    finally:
        source.close()


class Scripted:
    """An engine that answers every prompt with fixed ids (a tool call's text)."""

    def __init__(self, ids):
        self.ids = tuple(ids)

    def generate(self, prompts, seeds, max_new_tokens):
        return [EngineSample(response_tokens=self.ids, logprobs=(-0.25,) * len(self.ids),
                             finished=True) for _ in prompts]  # fmt: skip


def test_endpoint_keys_limits_and_tool_calls(tmp_path):
    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY, prompts=["x"],
                         max_request_bytes=2000)  # fmt: skip
    text = '<tool_call>{"name": "lookup", "arguments": {"q": "7"}}</tool_call>'
    source.engine = Scripted(source.tokenizer(text, add_special_tokens=False)["input_ids"] + [2])
    try:
        gateway = source.start_gateway()
        episode = gateway.open_episode("test episode", seed=0)
        client = openai.OpenAI(base_url=gateway.base_url, api_key=episode.key, max_retries=0)
        ask = [{"role": "user", "content": "x"}]
        reply = client.chat.completions.create(model="p", messages=ask,
                                               tools=gateway_agents.TOOLS)  # fmt: skip
        (tool_call,) = reply.choices[0].message.tool_calls
        assert tool_call.function.name == "lookup"
        assert json.loads(tool_call.function.arguments) == {"q": "7"}
        assert reply.choices[0].finish_reason == "tool_calls"
        # streamed: the tool call in a delta, then the finish reason
        chunks = list(client.chat.completions.create(
            model="p", messages=ask, tools=gateway_agents.TOOLS, stream=True))  # fmt: skip
        calls = [c for ch in chunks if ch.choices for c in ch.choices[0].delta.tool_calls or []]
        assert [c.function.name for c in calls] == ["lookup"]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
        streamed = "".join(
            ch.choices[0].text for ch in client.completions.create(
                model="p", prompt=[1, 5, 3], stream=True))  # fmt: skip
        assert streamed == text
        # the key in the URL instead of the header; the completions API with token ids
        by_url = openai.OpenAI(base_url=gateway.url_with_key(episode.key), api_key="-",
                               max_retries=0)  # fmt: skip
        done = by_url.completions.create(model="p", prompt=[1, 5, 3],
                                         extra_body={"return_token_ids": True})  # fmt: skip
        assert done.choices[0].text == text
        with pytest.raises(openai.BadRequestError, match=r"rollout\.temperature=1"):
            client.chat.completions.create(model="p", messages=ask, temperature=0.3)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=gateway.base_url, api_key="guess",
                          max_retries=0).models.list()  # fmt: skip
        big = httpx.post(gateway.base_url + "/chat/completions",
                         headers={"Authorization": f"Bearer {episode.key}"},
                         json={"messages": [{"role": "user", "content": "x" * 3000}]})  # fmt: skip
        assert big.status_code == 413 and "max_request_bytes=2000" in big.text
        calls = gateway.end_episode(episode)
        assert [c.endpoint for c in calls] == ["chat", "chat", "completion", "completion"]
        assert calls[3].prompt_ids == (1, 5, 3)
        with pytest.raises(openai.APIStatusError, match="has ended") as late:
            client.chat.completions.create(model="p", messages=ask)
        assert late.value.status_code == 410
    finally:
        source.close()


def test_eval_and_dynamic_sampling_on_the_agent_source(tmp_path):
    """The ``eval:`` section generates on the engine behind the gateway (no agent, its own
    random stream); dynamic sampling draws again until the groups differ in reward (the agent's
    reward here is 1 when the reply holds "7", so many groups are uniform)."""
    from unirl.rollouts.eval.evaluator import build_evaluator

    prompts = ["what is x?", "say 7", "seven?", "7?"]
    extra = {"eval": {"prompts": str(tmp_path / "prompts.jsonl"), "samples_per_prompt": 2}}
    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY, prompts=prompts,
                    extra=extra)  # fmt: skip
    try:
        evaluator = build_evaluator(source.cfg, source)
        before = source.inner.sampler.state_dict()["generator"].clone()
        metrics = evaluator.run(1)
        assert "eval/reward_mean" in metrics and source.engine.seen == []  # not through the gateway
        assert torch.equal(source.inner.sampler.state_dict()["generator"], before)
    finally:
        source.close()
    rollout = {"dynamic_sampling": {"enabled": True, "max_draws": 8}}
    cfg = make_config(tmp_path, agent="parity_agent", template=KEEPS_HISTORY, prompts=prompts)
    cfg = attrs.evolve(cfg, rollout=attrs.evolve(cfg.rollout, dynamic_sampling=attrs.evolve(
        cfg.rollout.dynamic_sampling, **rollout["dynamic_sampling"])))  # fmt: skip
    source = build_agent_source(cfg)
    try:
        batch = source.next_rollout(0)
        metrics = source.rollout_metrics()
    finally:
        source.close()
    assert metrics["rollout/draws"] >= 1 and metrics["rollout/padding_groups"] == 0
    groups: dict = {}
    for s in batch.samples:
        groups.setdefault(s.group_id, []).append(s.reward)
    assert len(groups) == 4 and all(len(set(r)) == 2 for r in groups.values())


def test_a_calls_sample_does_not_depend_on_its_batch(tmp_path):
    """Each call is drawn from a generator seeded by its own seed (the sampler's stream
    untouched), so a redrawn rollout, with calls batched as they happen to arrive, is the same
    (what a resumed run needs)."""
    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY,
                    prompts=["what is x?", "say 7"], concurrency=4)  # fmt: skip
    sampler = source.inner.sampler
    stream = sampler.state_dict()["generator"].clone()
    alone = sampler.generate([[1, 5, 6]], seeds=[11])[0]
    batched = sampler.generate([[1, 7, 8], [1, 5, 6], [1, 9]], seeds=[3, 11, 4])[1]
    assert alone.response_tokens.tolist() == batched.response_tokens.tolist()
    torch.testing.assert_close(alone.logprobs, batched.logprobs, atol=1e-5, rtol=0)
    assert torch.equal(sampler.state_dict()["generator"], stream)
    try:
        state = source.state_dict()
        first = source.next_rollout(0)
        source.load_state_dict(state)
        again = source.next_rollout(0)
    finally:
        source.close()
    for a, b in zip(first.samples, again.samples):
        assert a.response_tokens.tolist() == b.response_tokens.tolist()


def test_two_engines_each_episode_on_one_engine(tmp_path):
    """Two engines behind the gateway (the sampler stands in for vLLM): engine 1 is a second
    policy copy with other weights, served as a leader rank serves its engine to rank 0
    (gateway/remote.py over loopback, here in this process) and reporting policy version 7.
    The four episodes spread two and two; every call of an episode went to its engine, and its
    tokens are what that engine returned; each sample carries its engine's policy version."""
    import copy
    import threading

    from unirl.rollouts.gateway.engines import SamplerCalls
    from unirl.rollouts.gateway.remote import EngineServer, RemoteCalls

    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY,
                    prompts=["what is x?", "say 7"], concurrency=4)  # fmt: skip
    other = Recorded(SamplerCalls(copy.deepcopy(source.inner.sampler)))
    with torch.no_grad():  # other weights: the engines' samples differ
        for p in other.engine.sampler.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    server = EngineServer(other, version=lambda: 7, lock=threading.Lock())
    source.remote = [RemoteCalls(1, server.address, server.authkey, timeout_s=60)]
    source.engine_count = 2
    try:
        batch = source.next_rollout(0)
        metrics = source.rollout_metrics()
    finally:
        source.close()
        server.close()
    seen = {0: source.engine.seen, 1: other.seen}  # (prompt, sample) per engine
    assert [e.record.engine for e in source.last_episodes] == [0, 1, 0, 1]
    assert metrics["gateway/engine_imbalance"] == 1.0
    for engine in (0, 1):
        calls = [c for e in source.last_episodes if e.record.engine == engine for c in e.calls]
        assert len(calls) == len(seen[engine]) == 6  # 2 episodes x 3 calls, no call elsewhere
        returned = [(p, x.response_tokens, tuple(x.logprobs)) for p, x in seen[engine]]
        for c in calls:
            assert c.engine == engine and c.policy_version == (0, 7)[engine]
            assert (c.prompt_ids, c.completion_ids, c.logprobs) in returned
    for s in batch.samples:
        engine = s.metadata["agent"]["engine"]
        assert s.policy_version == (0, 7)[engine]
        assert set(s.metadata["agent"]["call_policy_versions"]) == {(0, 7)[engine]}


class SleepyLLM:
    """What `SleepCycle` calls on a vLLM engine, recorded; ``asleep`` while it sleeps."""

    def __init__(self):
        self.calls, self.asleep = [], False

    def sleep(self, level):
        self.calls.append(f"sleep({level})")
        self.asleep = True

    def wake_up(self, tags):
        self.calls.append(f"wake_up({tags[0]})")
        self.asleep = tags[0] != "kv_cache"

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def test_under_sleep_mode_the_engine_is_awake_for_the_episodes_only(tmp_path):
    """``rollout.agent.vllm.sleep`` (vLLM's sleep mode needs CUDA: a recording stand-in for the
    engine's sleep calls, the sampler generating): the engine wakes before a rollout's episodes
    and sleeps after them; every call the agents made met it awake; a call outside the episodes
    is refused with a named error."""
    from unirl.core.errors import RunError
    from unirl.rollouts.vllm.sleep import SleepCycle

    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY, prompts=["x"])
    llm = SleepyLLM()
    source.sleep_cycle = lambda: cycle
    cycle = SleepCycle(llm, "offload")
    awake_at_call = []
    engine = source.engine

    class Watched:  # each prompt of a batch: was the engine awake when it was generated
        def generate(self, prompts, seeds, max_new_tokens):
            awake_at_call.extend([not llm.asleep] * len(prompts))
            return engine.generate(prompts, seeds, max_new_tokens)

    source.engine = Watched()
    try:
        source.next_rollout(0)
        assert llm.calls == ["sleep(1)"] and awake_at_call == [True] * 6  # 2 episodes x 3
        source.next_rollout(1)
        assert llm.calls == ["sleep(1)", "wake_up(weights)", "wake_up(kv_cache)",
                             "reset_prefix_cache", "sleep(1)"]  # fmt: skip
        assert awake_at_call == [True] * 12
        late = source._router.submit(0, [1, 5, 3], seed=0, max_new_tokens=2)
        with pytest.raises(RunError, match=r"engine sleeps \(rollout.agent.vllm.sleep\)"):
            late.result(timeout=30)
        assert len(awake_at_call) == 12  # never reached the engine
    finally:
        source.close()


def test_the_engines_start_rules_name_the_agents_section(tmp_path):
    """The vLLM source's rules met when its engines start (the engine count against the world
    size, the GPU's free memory) or after the trainer's first RL step (the fit check) name the
    keys the user wrote: rollout.agent.vllm.*. The training loop asks the agent source for the
    fit check and whether this rank uses the weights: its engine's source answers (the sampler:
    no check, the weights used; a vLLM stand-in on a rank leading no engine: not used)."""
    from unirl.core.errors import ConfigError
    from unirl.rollouts.source import ChecksTrainerFit, uses_weights_here

    source = played(tmp_path, agent="tool_agent", template=KEEPS_HISTORY, prompts=["x"])

    class Refusing:
        def sync_weights(self, buckets, *, policy_version):
            raise ConfigError("rollout.vllm.engines=2 does not divide the 3 trainer processes")

        def check_trainer_fit(self):
            raise ConfigError("... Set rollout.vllm.gpu_memory_utilization <= 0.30 ...")

        def uses_weights_here(self):
            return False

        def close(self):
            pass

    assert isinstance(source, ChecksTrainerFit) and uses_weights_here(source)
    source.check_trainer_fit()  # the sampler: nothing to check
    inner, source.inner = source.inner, Refusing()
    try:
        with pytest.raises(ConfigError, match=r"^rollout\.agent\.vllm\.engines=2 does not"):
            source.sync_weights(iter(()), policy_version=1)
        with pytest.raises(ConfigError, match=r"Set rollout\.agent\.vllm\.gpu_memory_utiliz"):
            source.check_trainer_fit()
        assert not uses_weights_here(source)
    finally:
        inner.close()
        source.close()
