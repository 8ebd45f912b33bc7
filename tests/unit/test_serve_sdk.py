"""The official ``tinker`` SDK (unmodified) against `unirl serve` on the tiny model, each call
checked against a plain transformers + peft fp32 computation written here: log-probs and the
loss of ``forward`` / ``forward_backward`` (the SDK's built-in losses, each written out as the
Tinker docs define it), the custom-loss path, the adapter after one ``optim_step`` (torch's
AdamW on the peft model), ``sample`` / ``compute_logprobs`` on saved sampler weights, bad
requests (4xx naming the field, nothing changed) and two clients trained interleaved."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tinker import types  # noqa: E402

from tests.serve_fixtures import API_KEY, BASE, running_server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-2, weight_decay=0.0)


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("state")
    with running_server(tiny_folder, state_dir, max_request_bytes=200_000) as (url, runtime):
        yield url, runtime, state_dir


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server[0], api_key=API_KEY)
    yield client
    client.close("success")


def _datum(tokens, targets, **inputs) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, **inputs},
    )


SEQS = [([1, 5, 9, 13, 2], [5, 9, 13, 2, 7]), ([3, 4, 8], [4, 8, 60])]
WEIGHTS = [[0.0, 1.0, 1.0, 0.5, 1.0], [0.0, 2.0, -1.0]]


def _adapter_folder(state_dir: Path, model_id: str, name: str) -> Path:
    return state_dir / model_id.replace(":", "_") / "weights" / name / "adapter"


def _reference(tiny_folder: Path, adapter: Path) -> torch.nn.Module:
    """The base model in fp32 with the saved PEFT adapter, trainable: the reference."""
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)


def _logprobs(model: torch.nn.Module, tokens, targets) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


def _adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in state.items()}


def test_cross_entropy_step_and_custom_loss_match_peft(server, service, tiny_folder):
    _, _, state_dir = server
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    assert tc.get_info().lora_rank == 4
    tc.save_state("init").result()
    ref = _reference(tiny_folder, _adapter_folder(state_dir, tc.model_id, "init"))
    data = [_datum(t, y, weights=w) for (t, y), w in zip(SEQS, WEIGHTS)]
    out = tc.forward_backward(data, "cross_entropy").result()
    # cross_entropy: loss = -sum_t w_t logp_t, summed over the datums
    loss = sum(-(torch.tensor(w) * _logprobs(ref, t, y)).sum() for (t, y), w in zip(SEQS, WEIGHTS))
    assert out.metrics["loss:sum"] == pytest.approx(loss.item(), rel=1e-5)
    for (t, y), got in zip(SEQS, out.loss_fn_outputs):
        torch.testing.assert_close(got["logprobs"].to_torch(), _logprobs(ref, t, y).detach())
    tc.optim_step(types.AdamParams(**ADAM)).result()
    # the reference step: torch's AdamW over the adapter, the SDK's Adam parameters
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-2, weight_decay=0.0)
    loss.backward()
    opt.step()
    tc.save_state("step1").result()
    got = load_file(_adapter_folder(state_dir, tc.model_id, "step1") / "adapter_model.safetensors")
    want = _adapter(ref)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(
        not torch.equal(want[n], v)
        for n, v in _adapter(
            _reference(tiny_folder, _adapter_folder(state_dir, tc.model_id, "init"))
        ).items()
    )

    # forward_backward_custom: the SDK differentiates the loss client-side and sends -dC/dlogp
    # as cross-entropy weights; its loss:sum is the custom loss
    def custom(data, logprobs_list):
        return sum((lp**2).sum() for lp in logprobs_list), {}

    result = tc.forward_backward_custom(data, custom).result()
    want_custom = sum((_logprobs(ref, t, y) ** 2).sum() for t, y in SEQS)
    assert result.metrics["loss:sum"] == pytest.approx(want_custom.item(), rel=1e-5)


def _rl_datums(ref, advantages):
    """Two datums whose sampler log-probs are the reference's shifted per token, so that the
    ratios spread on both sides of the clip range."""
    data, parts = [], []
    shifts = [[0.0, 0.3, -0.4, 0.1, 0.05], [0.25, -0.1, 0.0]]
    for (t, y), adv, shift in zip(SEQS, advantages, shifts):
        logp = _logprobs(ref, t, y).detach()
        q = logp + torch.tensor(shift)
        data.append(_datum(t, y, logprobs=q.tolist(), advantages=adv))
        parts.append((logp, q, torch.tensor(adv)))
    return data, parts


def test_rl_losses_follow_the_sdk_formulas(server, service, tiny_folder):
    _, _, state_dir = server
    tc = service.create_lora_training_client(base_model=BASE, rank=2, seed=1).result()
    tc.save_state("init").result()
    ref = _reference(tiny_folder, _adapter_folder(state_dir, tc.model_id, "init"))
    data, parts = _rl_datums(ref, [[0.0, 1.0, -1.0, 2.0, 0.5], [0.0, -0.5, 1.5]])
    config = {"clip_low_threshold": 0.85, "clip_high_threshold": 1.1}

    def expected(name: str) -> float:
        total = 0.0
        for logp, q, adv in parts:
            ratio = torch.exp(logp - q)
            clipped = ratio.clamp(0.85, 1.1)
            if name == "importance_sampling":  # -(ratio * A).sum()
                total += float(-(ratio * adv).sum())
            elif name == "ppo":  # -min(ratio * A, clip(ratio) * A).sum()
                total += float(-torch.minimum(ratio * adv, clipped * adv).sum())
            elif name == "dro":  # -(logp * A - beta / 2 * (logp - q)^2).sum(), beta 0.3
                total += float(-(logp * adv - 0.5 * 0.3 * (logp - q) ** 2).sum())
            else:  # cispo: -(sg(clip(ratio)) * logp * A).sum()
                total += float(-(clipped * logp * adv).sum())
        return total

    configs = {"importance_sampling": None, "ppo": config, "cispo": config, "dro": {"beta": 0.3}}
    for name, cfg in configs.items():
        out = tc.forward(data, name, cfg).result()
        assert out.metrics["loss:sum"] == pytest.approx(expected(name), rel=1e-5), name
    # gspo: s = exp(mean over sequence_ratio_mask of (logp - q)) per datum, each token's loss
    # -min(s A_t, clip(s, lo, hi) A_t), summed; the bounds clip both datums' s (0.988, 1.051)
    ratio_masks = [[0.0, 1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
    gspo_data = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={**d.loss_fn_inputs, "sequence_ratio_mask": m},
        )
        for d, m in zip(data, ratio_masks)
    ]
    tight = {"clip_low_threshold": 0.995, "clip_high_threshold": 1.005}
    want = 0.0
    for (logp, q, adv), m in zip(parts, ratio_masks):
        in_ratio = torch.tensor(m) != 0
        s = torch.exp((logp - q)[in_ratio].mean())
        want += float(-torch.minimum(s * adv, s.clamp(0.995, 1.005) * adv).sum())
    out = tc.forward(gspo_data, "gspo", tight).result()
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    # the gradient: one PPO step against the same step on the peft model
    tc.forward_backward(data, "ppo", config).result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    ppo = sum(
        -torch.minimum(
            torch.exp(_logprobs(ref, t, y) - q) * adv,
            torch.exp(_logprobs(ref, t, y) - q).clamp(0.85, 1.1) * adv,
        ).sum()
        for (t, y), (_, q, adv) in zip(SEQS, parts)
    )
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-2, weight_decay=0.0)
    ppo.backward()
    opt.step()
    tc.save_state("step1").result()
    got = load_file(_adapter_folder(state_dir, tc.model_id, "step1") / "adapter_model.safetensors")
    for name, value in _adapter(ref).items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_sample_and_compute_logprobs_on_saved_sampler_weights(server, service, tiny_folder):
    _, _, state_dir = server
    tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    data = [_datum(t, y, weights=[1.0] * len(t)) for t, y in SEQS]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    tc.save_state("s").result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    ref = _reference(tiny_folder, _adapter_folder(state_dir, tc.model_id, "s")).eval()
    prompt = [1, 5, 9, 13]
    got = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert got[0] is None
    want = _logprobs(ref, prompt[:-1], prompt[1:]).detach()
    torch.testing.assert_close(torch.tensor(got[1:]), want, atol=1e-5, rtol=1e-5)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(prompt), prompt_logprobs_last_n=1)
    assert last.result() == [None, None, None, got[3]]
    params = types.SamplingParams(max_tokens=5, seed=7, temperature=1.0)
    res = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert len(res.sequences) == 2
    every = types.SamplingParams(max_tokens=5, seed=7, stop=list(range(64)))  # any token stops
    stopped = sampler.sample(types.ModelInput.from_ints(prompt), 2, every).result()
    assert [(len(q.tokens), q.stop_reason) for q in stopped.sequences] == [(1, "stop")] * 2
    for seq in res.sequences:
        full = prompt + list(seq.tokens)
        teacher = _logprobs(ref, full[:-1], full[1:]).detach()[len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(seq.logprobs), teacher, atol=1e-4, rtol=1e-4)
    # saved again under the same name after another step: the new weights are sampled
    path = tc.save_weights_for_sampler("same").result().path
    same = service.create_sampling_client(model_path=path)
    assert same.compute_logprobs(types.ModelInput.from_ints(prompt)).result() == got
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    tc.save_state("s2").result()
    assert tc.save_weights_for_sampler("same").result().path == path
    ref2 = _reference(tiny_folder, _adapter_folder(state_dir, tc.model_id, "s2")).eval()
    got2 = same.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want2 = _logprobs(ref2, prompt[:-1], prompt[1:]).detach()
    torch.testing.assert_close(torch.tensor(got2[1:]), want2, atol=1e-5, rtol=1e-5)


def _with_provenance(prompt: list[int], seq, advantage: float) -> types.Datum:
    """rl_loop's datum of one sampled sequence (the prompt, then all but the last sampled
    token; targets shifted by one; the advantage on the sampled targets), with its provenance."""
    n_prompt, n_sampled, sid = len(prompt), len(seq.tokens), seq.sequence_id
    datum = _datum(
        prompt + list(seq.tokens[:-1]),
        prompt[1:] + list(seq.tokens),
        logprobs=[0.0] * (n_prompt - 1) + list(seq.logprobs),
        advantages=[0.0] * (n_prompt - 1) + [advantage] * n_sampled,
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled),
        ],
    )


def test_stable_reinforce_on_recorded_samples_follows_its_formula(server, service, tiny_folder):
    """Sampled with record_stability_info, trained after one step moved the learner off the
    sampler: loss:sum is sum over the sampled targets of -(A logp - c ((rho - 1) - log rho)),
    rho = exp(logp - q), written out per token on the peft model; a malformed provenance is
    refused (400 naming the datum and the run or the input) and changes nothing."""
    _, _, state_dir = server
    tc = service.create_lora_training_client(base_model=BASE, rank=2, seed=5).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = [1, 5, 9, 13]
    params = types.SamplingParams(max_tokens=5, seed=3, stop=[])
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    advantages = [1.0, -0.5]
    data = [_with_provenance(prompt, q, a) for q, a in zip(seqs, advantages)]
    tc.forward_backward([_datum(*SEQS[0], weights=[1.0] * 5)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(**ADAM)).result()
    tc.save_state("moved").result()
    ref = _reference(tiny_folder, _adapter_folder(state_dir, tc.model_id, "moved"))
    got = []
    for config, c in ((None, 0.0), ({"kl_coeff": 0.5}, 0.5)):
        want = 0.0
        for d, seq, adv in zip(data, seqs, advantages):
            lp = _logprobs(ref, d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist())
            lp = lp.detach()
            for t, q in enumerate(seq.logprobs, start=len(prompt) - 1):  # the sampled targets
                lp_t = float(lp[t])
                rho = math.exp(lp_t - q)
                want += -(adv * lp_t - c * ((rho - 1.0) - (lp_t - q)))
        got.append(tc.forward(data, "stable_reinforce", config).result().metrics["loss:sum"])
        assert got[-1] == pytest.approx(want, rel=1e-5, abs=1e-5), config
    assert abs(got[1] - got[0]) > 1e-3  # the step moved the learner: the penalty is live

    good, sid = data[0], seqs[0].sequence_id
    n_prompt, n_sampled = len(prompt), len(seqs[0].tokens)
    prompt_run = types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt)
    cases = [
        (dataclasses.replace(good, model_input_spans=None, loss_fn_input_spans=None), ""),
        (
            dataclasses.replace(good, model_input_spans=[prompt_run]),  # does not tile
            "data[0].model_input_spans",
        ),
        (
            dataclasses.replace(
                good,
                model_input_spans=[
                    types.PromptProvenanceSpan(sequence_id="nowhere/0", length=n_prompt),
                    types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled - 1),
                ],
            ),
            "data[0].model_input_spans[0].sequence_id",
        ),
        (
            dataclasses.replace(  # the input holds sampled tokens 0..3, not 1..4
                good,
                model_input_spans=[
                    prompt_run,
                    types.SampledProvenanceSpan(sequence_id=sid, offset=1, length=n_sampled - 1),
                ],
            ),
            "data[0].model_input_spans[1]",
        ),
        (
            dataclasses.replace(  # past the sampled tokens
                good,
                loss_fn_input_spans=[
                    types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
                    types.SampledProvenanceSpan(sequence_id=sid, offset=1, length=n_sampled),
                ],
            ),
            "data[0].loss_fn_input_spans[1]",
        ),
    ]
    inputs = {k: v.tolist() for k, v in good.loss_fn_inputs.items()}
    for name, value, at in (("advantages", 1.0, 0), ("logprobs", -9.0, n_prompt)):
        changed = list(inputs[name])
        changed[at] = value  # an advantage on a prompt target; a sampled log-prob not recorded
        cases.append(
            (
                dataclasses.replace(good, loss_fn_inputs={**inputs, name: changed}),
                f"data[0].loss_fn_inputs.{name}",
            )
        )
    before = _probe(tc)
    for datum, field in cases:
        field = field or "data[0].loss_fn_input_spans"
        with pytest.raises(tinker.BadRequestError) as err:
            tc.forward_backward([datum], "stable_reinforce").result()
        assert err.value.status_code == 400 and field in str(err.value), str(err.value)
    assert _probe(tc) == before


def test_bad_requests_get_4xx_naming_the_field_and_change_nothing(server, service):
    url = server[0]
    tc = service.create_lora_training_client(base_model=BASE, rank=2).result()
    probe = [_datum(*SEQS[0], weights=[1.0] * 5)]
    before = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    cases = [
        (
            [_datum([1, 2, 3], [2, 3, 999], weights=[1.0] * 3)],
            "cross_entropy",
            None,
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            [_datum([1, 2, 3], [2, 3, 4], weights=[1.0] * 2)],
            "cross_entropy",
            None,
            "data[0].loss_fn_inputs.weights",
        ),
        (
            [_datum([1, 2, 3], [2, 3, 4], advantages=[1.0] * 3)],
            "ppo",
            None,
            "data[0].loss_fn_inputs",
        ),
        (  # stable_reinforce without provenance
            [_datum([1, 2], [2, 3], advantages=[0.0, 1.0])],
            "stable_reinforce",
            None,
            "data[0].loss_fn_input_spans",
        ),
        (probe, "custom", None, "loss_fn"),
        (
            [
                _datum(
                    [1, 2],
                    [2, 3],
                    logprobs=[0.0, 0.0],
                    advantages=[1.0, 1.0],
                    sequence_ratio_mask=[0.0, 1.0],
                )
            ],
            "gspo",
            {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
            "data[0].loss_fn_inputs.advantages",
        ),
        (
            [_datum([1, 2], [2, 3], logprobs=[0.0, 0.0], advantages=[1.0, 1.0])],
            "dro",
            None,
            "loss_fn_config.beta",
        ),
        (
            [_datum([1, 2], [2, 3], logprobs=[0.0, 0.0], advantages=[1.0, 1.0])],
            "ppo",
            {"clip_low_threshold": 1.5},
            "loss_fn_config",
        ),
    ]
    for data, loss_fn, config, field in cases:
        with pytest.raises(tinker.BadRequestError) as err:
            tc.forward_backward(data, loss_fn, config).result()
        assert err.value.status_code == 400 and field in str(err.value), str(err.value)
    saved_before = sorted(p.name for p in server[2].rglob("*"))
    with pytest.raises(tinker.BadRequestError, match="one path segment"):
        tc.save_state("../outside").result()
    with pytest.raises(tinker.BadRequestError, match="tinker://<model_id>/weights/<name>"):
        tc.load_state("tinker://nowhere").result()
    assert sorted(p.name for p in server[2].rglob("*")) == saved_before  # no checkpoint touched
    with pytest.raises(tinker.BadRequestError, match=r"adam_params\.beta1"):
        tc.optim_step(types.AdamParams(learning_rate=1e-2, beta1=1.5)).result()
    # nothing was applied: an optimizer step now has no gradient to take, the weights stand
    tc.optim_step(types.AdamParams(**ADAM)).result()
    after = tc.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.equal(before, after)
    big = [_datum(list(range(1, 61)) * 60, list(range(1, 61)) * 60, weights=[1.0] * 3600)] * 4
    with pytest.raises(tinker.APIStatusError) as err:  # over serve.max_request_bytes
        tc.forward_backward(big, "cross_entropy").result()
    assert err.value.status_code == 413 and "max_request_bytes" in str(err.value)
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").create_lora_training_client(
            base_model=BASE, rank=2
        ).result()


def _run_steps(tc, seqs_per_step):
    """Submit every request at once (the futures protocol), then read the losses."""
    futures = []
    for seqs in seqs_per_step:
        data = [_datum(t, y, weights=[1.0] * len(t)) for t, y in seqs]
        futures.append(tc.forward_backward(data, "cross_entropy"))
        tc.optim_step(types.AdamParams(**ADAM))
    return [f.result().metrics["loss:sum"] for f in futures]


def test_two_clients_interleaved_equal_each_alone(server, service):
    _, _, state_dir = server
    steps_a = [[SEQS[0]], [SEQS[1]]]
    steps_b = [[SEQS[1], SEQS[0]], [SEQS[0]]]
    a = service.create_lora_training_client(base_model=BASE, rank=4, seed=11).result()
    b = service.create_lora_training_client(base_model=BASE, rank=4, seed=12).result()
    loss_a, loss_b = [], []
    for step_a, step_b in zip(steps_a, steps_b):  # A, B, A, B: their requests interleave
        loss_a += _run_steps(a, [step_a])
        loss_b += _run_steps(b, [step_b])
    a.save_state("end").result()
    b.save_state("end").result()
    for seed, steps, losses, other in ((11, steps_a, loss_a, a), (12, steps_b, loss_b, b)):
        alone = service.create_lora_training_client(base_model=BASE, rank=4, seed=seed).result()
        assert _run_steps(alone, steps) == losses
        alone.save_state("end").result()
        want = load_file(
            _adapter_folder(state_dir, other.model_id, "end") / "adapter_model.safetensors"
        )
        got = load_file(
            _adapter_folder(state_dir, alone.model_id, "end") / "adapter_model.safetensors"
        )
        for name in want:
            assert torch.equal(got[name], want[name]), name


def _probe(tc) -> list[float]:
    data = [_datum(*SEQS[0], weights=[1.0] * 5)]
    return tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


def test_state_round_trip_with_and_without_the_optimizer(service):
    tc = service.create_lora_training_client(base_model=BASE, rank=2, seed=4).result()
    _run_steps(tc, [[SEQS[0]]])
    path = tc.save_state("rt").result().path
    saved = _probe(tc)
    _run_steps(tc, [[SEQS[1]]])
    after = _probe(tc)
    # with the optimizer: the same next step gives the same weights (Adam's moments restored)
    full = service.create_training_client_from_state_with_optimizer(path).result()
    assert _probe(full) == saved
    _run_steps(full, [[SEQS[1]]])
    assert _probe(full) == after
    # weights only: the saved adapter, a fresh optimizer (its next step differs)
    weights = service.create_training_client_from_state(path).result()
    assert _probe(weights) == saved
    _run_steps(weights, [[SEQS[1]]])
    assert _probe(weights) != after


def test_a_server_fault_stops_the_client_instead_of_training_on_partial_gradients(server, service):
    """A backend error mid forward_backward fails that request (category server) and every later
    request of the client (400, naming what to do); other clients go on."""
    runtime = server[1]
    tc = service.create_lora_training_client(base_model=BASE, rank=2).result()
    other = service.create_lora_training_client(base_model=BASE, rank=2).result()
    backend = runtime.sessions.get(tc.model_id).backend

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    backend.forward_backward = broken  # this client's backend only
    data = [_datum(*SEQS[0], weights=[1.0] * 5)]
    with pytest.raises(tinker.RequestFailedError, match="injected fault"):
        tc.forward_backward(data, "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="create_training_client_from_state"):
        tc.optim_step(types.AdamParams(**ADAM)).result()
    assert other.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0


def test_yes_no_fields_are_booleans(server):
    """The SDK sends JSON booleans; another client's string "false" is a 400 naming the field,
    never read as yes (it would record stability info or compute prompt log-probs)."""
    import httpx

    body = {
        "base_model": BASE,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "num_samples": 1,
        "sampling_params": {"max_tokens": 2, "seed": 0},
    }
    for field in ("record_stability_info", "prompt_logprobs"):
        r = httpx.post(
            f"{server[0]}/api/v1/asample",
            json={**body, field: "false"},
            headers={"X-API-Key": API_KEY},
        )
        assert r.status_code == 400 and field in r.text, r.text
