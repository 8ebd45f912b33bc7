"""The SDK's sample request as vLLM's SamplingParams and vLLM's answer as the SDK's sequences
(`unirl.serve.vllm_params`), without an engine: each mapping written out by hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("tinker")
from unirl.serve.sampling import SampleJob
from unirl.serve.vllm_params import prompt_logprobs, sampling_kwargs, wire_sequences


def _job(**over) -> SampleJob:
    fields = dict(weights=Path("/w"), base_model="m", model_path=None, prompt=(1, 2, 3),
                  num_samples=3, max_tokens=5, temperature=0.7, top_p=0.9, top_k=-1, seed=11,
                  stop_tokens=None, prompt_logprobs=False)  # fmt: skip
    return SampleJob(**{**fields, **over})


def test_sampling_params_by_hand():
    assert sampling_kwargs(_job(), eos_ids=[2]) == {
        "n": 3, "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
        "top_k": 0,  # the SDK's -1 (no top-k) is vLLM's 0
        "seed": 11, "stop_token_ids": [2],  # stop None: the model's EOS
        "ignore_eos": True, "logprobs": 0, "prompt_logprobs": None, "detokenize": False,
    }  # fmt: skip
    kw = sampling_kwargs(_job(top_k=4, stop_tokens=(), prompt_logprobs=True), eos_ids=[2])
    assert (kw["top_k"], kw["stop_token_ids"], kw["prompt_logprobs"]) == (4, [], 0)
    assert sampling_kwargs(_job(stop_tokens=(7, 9)), eos_ids=[2])["stop_token_ids"] == [7, 9]


def test_outputs_as_the_sdk_sequences():
    lp = lambda x: SimpleNamespace(logprob=x)  # noqa: E731
    done = SimpleNamespace(token_ids=[4, 2], logprobs=[{4: lp(-0.5), 9: lp(-3.0)}, {2: lp(-1.25)}],
                           finish_reason="stop")  # fmt: skip
    cut = SimpleNamespace(token_ids=[6], logprobs=[{6: lp(-2.0)}], finish_reason="length")
    (a, b) = wire_sequences([done, cut])
    assert a.tokens.tolist() == [4, 2] and a.logprobs.tolist() == [-0.5, -1.25] and a.stopped
    assert b.tokens.tolist() == [6] and b.logprobs.tolist() == [-2.0] and not b.stopped
    per_position = [None, {2: lp(-0.75), 5: lp(-1.0)}, {3: lp(-0.25)}]
    got = prompt_logprobs((1, 2, 3), per_position)
    assert np.isnan(got[0]) and got[1:].tolist() == [-0.75, -0.25]


@pytest.mark.parametrize(
    "over, field",
    [
        ({"topk_prompt_logprobs": 2}, "topk_prompt_logprobs"),
        ({"topk_sample_logprobs": 1}, "topk_sample_logprobs"),
        ({"prompt_alt_tokens_k": 3}, "prompt_alt_tokens_k"),
        ({"target_prompt_logprobs": {"data": [1]}}, "target_prompt_logprobs"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 3}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 1}, "prompt_logprobs_last_n"),  # without prompt_logprobs
    ],
)
def test_what_the_server_does_not_compute_is_refused_by_name(over, field):
    from unirl.serve.errors import BadRequest
    from unirl.serve.sampling import SampleSeeds, sample_job

    body = {"prompt": {"chunks": [{"tokens": [1, 2, 3]}]}, "sampling_params": {"seed": 1}}
    kw = dict(
        base_model="m", model_path=None, max_sample_tokens=64, seeds=SampleSeeds(0), top_k=True
    )
    sample_job({**body, "prompt_logprobs": True, "prompt_logprobs_last_n": 2}, Path("/w"), **kw)
    with pytest.raises(BadRequest, match=f"^{field} is"):
        sample_job({**body, **over}, Path("/w"), **kw)


def test_sampler_weights_saved_again_under_one_name_share_no_prefix_cache(tmp_path, monkeypatch):
    """vLLM keys its prefix-cache blocks by ("lora", lora_name, lora_path)
    (vllm/v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`): weights saved again under the
    same name must get another key, else a prompt seen before is answered from the keys and
    values the old adapter computed."""
    import json
    import os
    from collections import OrderedDict

    pytest.importorskip("vllm")
    from unirl.serve import state, vllm_engine
    from unirl.serve.state import PartialWrite
    from unirl.serve.vllm_engine import ServeEngine

    engine = object.__new__(ServeEngine)  # the adapter bookkeeping, no engine started
    engine.dtype, engine.receiver, engine.base = "fp32", "the engine", None
    engine.adapters, engine._next_id = OrderedDict(), 1
    removed: list[int] = []
    engine.engine = SimpleNamespace(
        llm=SimpleNamespace(llm_engine=SimpleNamespace(remove_lora=removed.append))
    )
    monkeypatch.setattr(ServeEngine, "_deliver_adapter", lambda self, request: None)
    monkeypatch.setattr(vllm_engine, "check_served_adapter", lambda *a, **k: None)
    saved = tmp_path / "sampler_weights" / "step"
    os.makedirs(saved.parent)

    def save(value: float) -> None:  # as save_weights_for_sampler does: a new folder renamed
        with PartialWrite(saved) as tmp:  # into place, its adapter's fingerprint in meta.json
            (tmp / state.ADAPTER).mkdir()
            meta = {"adapter_dtype": "fp32", "adapter_fingerprint": {"a": [value]}}
            (tmp / state.META).write_text(json.dumps(meta))

    uri = "tinker://m/sampler_weights/step"
    save(1.0)
    first = engine.adapter(saved, uri)
    assert engine.adapter(saved, uri) is first  # the same weights: loaded once
    save(2.0)
    second = engine.adapter(saved, uri)
    assert removed == [first.lora_int_id]  # the old adapter left the engine
    keys = {("lora", r.lora_name, r.lora_path) for r in (first, second)}
    assert len(keys) == 2


@pytest.mark.parametrize(
    "kind, detail, named",
    [
        ("died", "its process 7 is gone (killed, or out of memory)", "its process 7 is gone"),
        # a hung engine's detail names the serve engine's key (serve.vllm, not rollout.vllm)
        ("hung", "it made no progress for rollout.vllm.stall_timeout_s=300 s",
         "it made no progress for serve.vllm.stall_timeout_s=300 s"),
    ],
)  # fmt: skip
def test_an_engine_that_fails_loading_the_adapter_is_closed_and_named(kind, detail, named):
    """An engine that dies (or hangs) while it loads the sampler weights' adapter fails that
    request naming the base model's engine and is closed at once (its processes gone), as one
    that fails while it generates: not left running until some later sample request."""
    pytest.importorskip("vllm")
    from unirl.core.errors import RunError
    from unirl.rollouts.vllm.health import EngineFailure
    from unirl.serve.vllm_sampling import VllmSampling

    closed: list[str] = []

    class DeadEngine:  # loading the adapter finds the engine core gone
        receiver, vocab_size, max_model_len, eos_ids = "the vLLM engine of 'm'", 8, 64, [2]
        failed = False

        def adapter(self, saved, model_path):
            self.failed = True
            raise EngineFailure(kind, detail)

        def close(self) -> None:
            closed.append("m")

    sampling = VllmSampling(cfg=None)  # type: ignore[arg-type]
    sampling.engines["m"] = DeadEngine()  # type: ignore[assignment]
    with pytest.raises(RunError) as err:
        sampling.run(_job(model_path="tinker://m/sampler_weights/step"))
    assert str(err.value).startswith(f"the vLLM engine of 'm' failed ({named}")
    assert closed == ["m"] and sampling.engines == {}


def test_a_temperature_vllm_would_raise_is_refused_by_name():
    """vLLM samples at 0.01 any temperature in (0, 0.01) (SamplingParams.__post_init__, its
    _MAX_TEMP), and its log-probs are then those of 0.01: such a request is refused, naming the
    field, instead of answered at another temperature than the one asked for."""
    from unirl.serve.errors import BadRequest
    from unirl.serve.vllm_params import check_sample

    with pytest.raises(BadRequest, match=r"^sampling_params.temperature is 0.005; .*0.01"):
        check_sample(_job(temperature=0.005))
    check_sample(_job(temperature=0.01))  # vLLM samples 0.01 as it is


def test_a_seed_vllm_reads_as_none_is_refused_by_name():
    """vLLM reads seed -1 as no seed (SamplingParams.__post_init__): a request seeded -1 would
    be sampled unseeded, differently on every call; a negative seed is refused, naming it."""
    from unirl.serve.errors import BadRequest
    from unirl.serve.vllm_params import check_sample

    with pytest.raises(BadRequest, match=r"^sampling_params.seed is -1; .*0 or more"):
        check_sample(_job(seed=-1))
    check_sample(_job(seed=0))


def test_the_serve_engine_takes_tensor_parallel_size_gpus_of_the_server(monkeypatch):
    """serve.vllm.tensor_parallel_size: 2 on a server that sees 2 GPUs: the engine runs on GPUs
    0 and 1 (it was planned as one trainer GPU's colocated engine, so any size > 1 failed every
    sample request on a GPU); more than the server sees is refused naming serve.vllm."""
    pytest.importorskip("vllm")
    from unirl.core.errors import ConfigError
    from unirl.rollouts.vllm.plugin import VllmOptions
    from unirl.serve.vllm_engine import serve_launch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launch = serve_launch(VllmOptions(tensor_parallel_size=2), cuda=True, gpus=2)
    assert launch.devices == (0, 1) and launch.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert serve_launch(VllmOptions(), cuda=True, gpus=2).devices == (0,)
    assert serve_launch(VllmOptions(tensor_parallel_size=2), cuda=False, gpus=0).devices is None
    with pytest.raises(ConfigError, match=r"^serve.vllm.tensor_parallel_size=4 .* 2 GPUs"):
        serve_launch(VllmOptions(tensor_parallel_size=4), cuda=True, gpus=2)


def test_new_sampler_weights_whose_meta_json_took_a_freed_inode_are_loaded_anew(
    tmp_path, monkeypatch
):
    """A file system gives a freed inode to a later file (ext4 does): weights saved again under
    one name whose meta.json gets the inode of the meta.json of weights loaded earlier are new
    weights, loaded and checked, not answered by the earlier adapter. Written here in place,
    which keeps the inode as such a reuse does."""
    import json
    from collections import OrderedDict

    pytest.importorskip("vllm")
    from unirl.serve import state, vllm_engine
    from unirl.serve.vllm_engine import ServeEngine

    engine = object.__new__(ServeEngine)
    engine.dtype, engine.receiver, engine.base = "fp32", "the engine", None
    engine.adapters, engine._next_id = OrderedDict(), 1
    engine.engine = SimpleNamespace(
        llm=SimpleNamespace(llm_engine=SimpleNamespace(remove_lora=lambda lora_id: None))
    )
    checked: list[dict] = []
    monkeypatch.setattr(ServeEngine, "_deliver_adapter", lambda self, request: None)
    monkeypatch.setattr(vllm_engine, "check_served_adapter", lambda *a, **k: checked.append(a))
    saved = tmp_path / "step"
    (saved / state.ADAPTER).mkdir(parents=True)
    meta = saved / state.META
    meta.write_text(json.dumps({"adapter_dtype": "fp32", "adapter_fingerprint": {"a": [1.0]}}))
    first = engine.adapter(saved, "tinker://m/sampler_weights/step")
    inode = meta.stat().st_ino
    meta.write_text(json.dumps({"adapter_dtype": "fp32", "adapter_fingerprint": {"a": [2.0]}}))
    assert meta.stat().st_ino == inode
    second = engine.adapter(saved, "tinker://m/sampler_weights/step")
    assert second.lora_int_id != first.lora_int_id and len(checked) == 2


def test_an_engine_that_does_not_start_names_serve_vllm(tmp_path, monkeypatch):
    """The start's error names the settings a serve config has (serve.vllm.*), not the
    rollout.vllm section unirl serve refuses."""
    import json

    pytest.importorskip("vllm")
    from unirl.core.errors import RunError
    from unirl.serve import vllm_engine
    from unirl.serve.config import serve_config_from_dict

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 8}))
    data = {"base_models": {"m": str(tmp_path)}, "train": {}, "state_dir": str(tmp_path / "s")}
    cfg = serve_config_from_dict(
        {**data, "api_key": "tml-k", "sampling": "vllm", "vllm": {"dtype": "fp32"}}
    )

    def fails(*args, **kwargs):  # the error VllmEngine.start raises (engine.py)
        raise RunError("the vLLM engine did not start (ValueError: no KV cache). Check "
                       "rollout.vllm (dtype=fp32, kv_cache_gb=auto, ...)")  # fmt: skip

    monkeypatch.setattr(vllm_engine.VllmEngine, "start", fails)
    with pytest.raises(RunError) as err:
        vllm_engine.ServeEngine(cfg, "m")
    assert "Check serve.vllm (dtype=fp32" in str(err.value)
    assert "rollout.vllm" not in str(err.value)
