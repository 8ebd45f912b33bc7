"""`unirl serve` on Megatron under torchrun (two processes, rank 0 serving): the official SDK's
LoRA step (loss, log-probs, clipped Adam step, saved adapter) against peft + torch's AdamW, as
the one-process backends are checked in tests/unit/test_serve_backends.py; then sampler weights
(a collective export) and a sample from them on rank 0, and a clean stop of both ranks."""

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
pytest.importorskip("megatron.core")
from tinker import types  # noqa: E402

from tests.serve_fixtures import API_KEY, BASE, free_port, serve_dict  # noqa: E402
from tests.unit.test_serve_backends import assert_matches_peft, sdk_step  # noqa: E402


def _launch(config: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "unirl.cli",
        "serve",
        str(config),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", headers={"X-API-Key": API_KEY})
            if r.status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("unirl serve under torchrun did not answer within 180 s")


def _rank0(proc: subprocess.Popen) -> int:
    """The pid of torchrun's worker of rank 0 (its environment says RANK=0)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == proc.pid and b"RANK=0" in env:
            return int(entry.name)
    raise AssertionError("torchrun has no worker of rank 0")


@pytest.mark.slow  # two megatron processes under torchrun (about a minute per layout)
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_megatron_under_torchrun_matches_peft(tmp_path, parallel):
    from tests.hf_reference import save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    port = free_port()
    train = {
        "backend": "megatron",
        "model": {"dtype": "fp32"},
        "parallel": parallel,
        "progress": {"enabled": False},
    }
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve_dict(folder, tmp_path / "state", port, train=train)))
    log = tmp_path / "serve.log"
    proc = _launch(config, port, log)
    try:
        url = f"http://127.0.0.1:{port}"
        got = sdk_step(url, tmp_path / "state", unembed=True)
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        tc = service.create_lora_training_client(base_model=BASE, rank=2)
        sampler = tc.result().save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints([1, 5, 9])
        params = types.SamplingParams(max_tokens=3, seed=0, stop=[])
        sample = sampler.sample(prompt, 2, params).result()
        assert [len(s.tokens) for s in sample.sequences] == [3, 3]
        service.close("success")
    finally:
        os.kill(_rank0(proc), signal.SIGINT)  # uvicorn stops; rank 0 tells rank 1; both exit
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            raise AssertionError(
                "the ranks did not stop within 60 s: " + log.read_text()[-4000:]
            ) from exc
    assert rc == 0, log.read_text()[-4000:]
    assert_matches_peft(folder, got)
