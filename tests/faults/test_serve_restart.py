"""A `unirl serve` killed (SIGKILL) with a save in flight restarts from its last saved state:
the state saved before the kill loads into a new server on the same ``state_dir`` with its
adapter and optimizer state (one more identical step gives the numbers the first server gave),
and the save the kill interrupted is either complete or refused by name, never half-read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

tinker = pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker import types  # noqa: E402

from tests.serve_fixtures import API_KEY, BASE, free_port, serve_dict  # noqa: E402

DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 9, 13]),
        loss_fn_inputs={"target_tokens": [5, 9, 13, 2], "weights": [0.0, 1.0, 1.0, 1.0]},
    )
]
ADAM = types.AdamParams(learning_rate=1e-2, eps=1e-2)


def _start(config: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "UNIRL_SERVE_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.cli", "serve", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", headers={"X-API-Key": API_KEY})
            if r.status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("unirl serve did not answer within 120 s")


def _config(tmp_path: Path, folder: Path, port: int) -> Path:
    data = serve_dict(folder, tmp_path / "state", port)
    del data["api_key"]
    data["api_key_env"] = "UNIRL_SERVE_API_KEY"  # the key from the environment, as documented
    path = tmp_path / f"serve-{port}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _step_and_probe(tc) -> list[float]:
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    return tc.forward(DATA, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()


@pytest.mark.slow  # two server processes (~80 s); the state round trip runs in-process in
# tests/unit/test_serve_sdk.py
def test_killed_server_restarts_from_its_last_saved_state(tmp_path):
    from tests.hf_reference import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    port = free_port()
    proc = _start(_config(tmp_path, folder, port), port)
    try:
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY)
        tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
        _step_and_probe(tc)
        saved = tc.save_state("good").result().path
        after_saved = _step_and_probe(tc)  # the step the restarted server must repeat exactly
        tc.save_state("interrupted")  # in flight when the server dies
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    port2 = free_port()
    proc2 = _start(_config(tmp_path, folder, port2), port2)
    try:
        service2 = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port2}", api_key=API_KEY)
        restored = service2.create_training_client_from_state_with_optimizer(saved).result()
        assert _step_and_probe(restored) == after_saved
        interrupted = saved.replace("/good", "/interrupted")
        try:
            service2.create_training_client_from_state_with_optimizer(interrupted).result()
        except tinker.BadRequestError as err:  # killed before the rename: refused by name
            assert "never completely saved" in str(err)
    finally:
        proc2.send_signal(signal.SIGTERM)
        proc2.wait(60)
