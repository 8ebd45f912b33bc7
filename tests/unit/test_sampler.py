"""The built-in sampler: its rollout log-probs against an independent forward of the policy."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.tiny_models import tiny_llama
from unirl.core.errors import ConfigError
from unirl.rollouts.sampler import Sampler, top_p_filter

EOS = 2
VOCAB = 14


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int, *, tie: bool = False) -> torch.nn.Module:
    """The tiny Llama with this file's vocabulary (also test_stops.py's model)."""
    return tiny_llama(VOCAB, seed, tie=tie)


# Prompts of three lengths, as the tasks make them: <bos> digits <sep>.
PROMPTS = [[1, 5, 6, 3], [1, 7, 8, 9, 3], [1, 4, 4, 3], [1, 13, 12, 11, 10, 3], [1, 9, 5, 3]]


def reference_logprobs(model, prompt, response, temperature):
    """log_softmax(logits / T) of one full sequence, gathered at the response tokens: the
    response token at position j is predicted by the logits at j - 1."""
    full = torch.tensor(prompt + response)[None]
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    p = len(prompt)
    return torch.stack([logp[p - 1 + j, tok] for j, tok in enumerate(response)])


def make_sampler(model, **overrides):
    kwargs = dict(temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=EOS, seed=0)
    kwargs.update(overrides)
    return Sampler(model, **kwargs)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_rollout_logprobs_equal_an_independent_forward(temperature):
    model = tiny_model(0)
    sampler = make_sampler(model, temperature=temperature, seed=1)
    prompts = PROMPTS * 3
    gens = sampler.generate(prompts)
    assert len(gens) == len(prompts)
    for prompt, gen in zip(prompts, gens):
        response = gen.response_tokens.tolist()
        assert gen.logprobs.dtype == torch.float32
        assert gen.logprobs.shape == gen.response_tokens.shape
        ref = reference_logprobs(model, prompt, response, temperature)
        torch.testing.assert_close(gen.logprobs, ref, atol=1e-5, rtol=0)


def test_stops_at_eos_and_respects_the_budget():
    model = tiny_model(2)
    # A flat distribution (T = 2) over 14 ids makes <eos> likely within 8 steps for some rows.
    gens = make_sampler(model, temperature=2.0, max_new_tokens=8, seed=3).generate(PROMPTS * 12)
    finished = [g for g in gens if g.finished]
    unfinished = [g for g in gens if not g.finished]
    assert finished and unfinished  # both paths were exercised
    for g in finished:
        tokens = g.response_tokens.tolist()
        assert tokens[-1] == EOS and EOS not in tokens[:-1] and len(tokens) <= 8
    for g in unfinished:
        assert len(g.response_tokens) == 8 and EOS not in g.response_tokens.tolist()
    short = make_sampler(model, temperature=2.0, max_new_tokens=3, seed=3).generate(PROMPTS * 12)
    assert max(len(g.response_tokens) for g in short) == 3
    assert all(len(g.response_tokens) == 3 for g in short if not g.finished)


class RecordingProgress:
    """Stands in for `GenerationProgress`: records every update the sampler makes."""

    def __init__(self):
        self.updates = []

    def update(self, *, samples=0, tokens=0):
        self.updates.append((samples, tokens))


def test_progress_hears_every_sample_and_every_generated_token():
    model = tiny_model(2)
    prompts = PROMPTS * 12  # 60 samples in three length groups; some end by <eos>, some by budget
    progress = RecordingProgress()
    gens = make_sampler(model, temperature=2.0, max_new_tokens=8, seed=3).generate(
        prompts, progress=progress
    )
    assert any(g.finished for g in gens) and not all(g.finished for g in gens)
    # the totals, counted from the returned responses: one sample each, their tokens
    assert sum(s for s, _ in progress.updates) == len(prompts)
    assert sum(t for _, t in progress.updates) == sum(len(g.response_tokens) for g in gens)
    # one update per decode step of each of the 3 prompt lengths (4, 5, 6): 1 to 8 steps each
    assert 3 <= len(progress.updates) <= 3 * 8
    # the same samples with and without a bar
    plain = make_sampler(model, temperature=2.0, max_new_tokens=8, seed=3).generate(prompts)
    assert all(torch.equal(a.response_tokens, b.response_tokens) for a, b in zip(gens, plain))


def test_same_seed_same_samples():
    model = tiny_model(0)
    a = make_sampler(model, seed=5).generate(PROMPTS * 4)
    b = make_sampler(model, seed=5).generate(PROMPTS * 4)
    c = make_sampler(model, seed=6).generate(PROMPTS * 4)
    assert all(torch.equal(x.response_tokens, y.response_tokens) for x, y in zip(a, b))
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    assert any(not torch.equal(x.response_tokens, y.response_tokens) for x, y in zip(a, c))


def test_generator_state_round_trip():
    model = tiny_model(0)
    sampler = make_sampler(model, seed=9)
    sampler.generate(PROMPTS)
    state = sampler.state_dict()
    expected = sampler.generate(PROMPTS)
    other = make_sampler(model, seed=123)
    other.load_state_dict(state)
    got = other.generate(PROMPTS)
    assert all(torch.equal(x.response_tokens, y.response_tokens) for x, y in zip(expected, got))


def test_weight_sync_changes_logprobs_to_the_new_models():
    old, new = tiny_model(0), tiny_model(1)
    sampler = make_sampler(old, seed=4)
    sampler.sync_weights(new.state_dict())
    gens = sampler.generate(PROMPTS * 2)
    gap = 0.0
    for prompt, gen in zip(PROMPTS * 2, gens):
        response = gen.response_tokens.tolist()
        ref_new = reference_logprobs(new, prompt, response, 1.0)
        torch.testing.assert_close(gen.logprobs, ref_new, atol=1e-5, rtol=0)
        ref_old = reference_logprobs(old, prompt, response, 1.0)
        gap = max(gap, float((gen.logprobs - ref_old).abs().max()))
    assert gap > 1e-2  # the old weights would give other log-probs
    # The sampler owns a copy: the model it was built from is untouched.
    assert torch.equal(old.lm_head.weight, tiny_model(0).lm_head.weight)


def test_weight_sync_key_checks():
    tied = tiny_model(0, tie=True)
    sampler = make_sampler(tied)
    source = tiny_model(1, tie=True).state_dict()
    # A tied lm_head may be left out of an export: it is the embedding.
    sampler.sync_weights({k: v for k, v in source.items() if k != "lm_head.weight"})
    assert torch.equal(sampler.model.lm_head.weight, source["model.embed_tokens.weight"])
    with pytest.raises(ConfigError, match=r"lacks \['model.norm.weight'\]"):
        sampler.sync_weights({k: v for k, v in source.items() if k != "model.norm.weight"})
    with pytest.raises(ConfigError, match=r"unexpected keys \['extra.weight'\]"):
        sampler.sync_weights({**source, "extra.weight": torch.zeros(1)})
    with pytest.raises(ConfigError, match=r"do not fit"):
        sampler.sync_weights({**source, "model.norm.weight": torch.zeros(5)})


def test_top_p_filter_hand_values():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    # Sorted: 0.5, 0.3, 0.15, 0.05; mass ranked above each: 0, 0.5, 0.8, 0.95.
    # top_p 0.6 drops tokens whose higher-ranked mass already reaches 0.6: 0.15 and 0.05.
    expected = torch.tensor([[0.0, 0.5, 0.0, 0.3]])
    torch.testing.assert_close(top_p_filter(probs, 0.6), expected)
    # top_p 0.4: only the most likely token (mass above it 0 < 0.4; next 0.5 >= 0.4).
    torch.testing.assert_close(top_p_filter(probs, 0.4), torch.tensor([[0.0, 0.5, 0.0, 0.0]]))
    assert top_p_filter(probs, 1.0) is probs


def test_tiny_top_p_is_greedy_and_reports_unfiltered_logprobs():
    model = tiny_model(0)
    gens = make_sampler(model, top_p=1e-6, temperature=0.8).generate(PROMPTS)
    for prompt, gen in zip(PROMPTS, gens):
        response = gen.response_tokens.tolist()
        full = torch.tensor(prompt + response)[None]
        with torch.no_grad():
            logits = model(input_ids=full).logits[0].float()
        p = len(prompt)
        for j, tok in enumerate(response):
            assert tok == int(logits[p - 1 + j].argmax())
        # The reported log-prob is of softmax(logits / T) over the whole vocabulary, not of
        # the truncated distribution (where the greedy token has probability 1, log-prob 0).
        ref = reference_logprobs(model, prompt, response, 0.8)
        torch.testing.assert_close(gen.logprobs, ref, atol=1e-5, rtol=0)
        assert float(gen.logprobs.max()) < -1e-3


def test_bad_settings_raise_config_errors():
    model = tiny_model(0)
    with pytest.raises(ConfigError, match=r"rollout.temperature=0.0 must be > 0"):
        make_sampler(model, temperature=0.0)
    with pytest.raises(ConfigError, match=r"rollout.top_p=0.0 must be in \(0, 1\]"):
        make_sampler(model, top_p=0.0)
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens=0"):
        make_sampler(model, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        make_sampler(model).generate([[1, 3], []])


def _per_expert(state: dict) -> dict:
    """transformers 5's fused experts written out under the per-expert checkpoint names (what
    the Megatron backend streams), by hand: gate rows, then up rows of ``gate_up_proj``."""
    out = {}
    for name, t in state.items():
        prefix, _, which = name.rpartition(".")
        if which == "gate_up_proj":
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
        elif which == "down_proj" and prefix.endswith("mlp.experts"):
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "qwen3-moe"])
def test_weights_loaded_bucket_by_bucket(moe):
    """Issue 28: a stream of small buckets (a layer's experts split over several) leaves the
    sampler's model holding exactly the weights streamed."""
    from unirl.core.weights.stream import bucketed

    if moe:
        from tests.unit.replay_fixtures import MOE_HF

        hf = dict(MOE_HF)
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
        torch.manual_seed(0)
        old = AutoModelForCausalLM.from_config(config).eval()
        torch.manual_seed(1)
        new = AutoModelForCausalLM.from_config(config).eval()
    else:
        old, new = tiny_model(0), tiny_model(1)
    sampler = make_sampler(old)
    streamed = _per_expert(new.state_dict()) if moe else new.state_dict()
    buckets = list(bucketed(streamed.items(), 700))
    assert len(buckets) > 5
    sampler.load_buckets(iter(buckets))
    own = sampler.model.state_dict()
    for name, value in new.state_dict().items():
        assert torch.equal(own[name], value), name
    if moe:  # one expert's down projection missing: the layer cannot be fused
        dropped = [(n, t) for n, t in streamed.items() if n != next(iter(_experts(streamed)))]
        with pytest.raises(ConfigError, match="incomplete"):
            sampler.load_buckets(bucketed(dropped, 700))
    with pytest.raises(ConfigError, match=r"lacks \['model.embed_tokens.weight'"):
        sampler.load_buckets(
            bucketed([(n, t) for n, t in streamed.items() if "embed" not in n], 700)
        )


def _experts(state: dict) -> list[str]:
    return [n for n in state if n.endswith("down_proj.weight") and ".experts." in n]
