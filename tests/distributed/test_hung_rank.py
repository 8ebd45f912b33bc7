"""Issue 15, finding 6: a hung rank ends the whole job within ``parallel.timeout_s``.

Two ranks of the tiny example under torchrun; once training runs, rank 1 is stopped with SIGSTOP
(it can no longer answer, nor see the launcher's SIGTERM). Before, rank 0 waited in its next
collective for the hard-coded 30 minutes. Now its collective times out after
``parallel.timeout_s``, it stops the hung rank on its host and exits with one error line, and
torchrun ends with a non-zero status, all within the timeout plus a margin for the shutdown."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")

from tests.spawn import free_port

TINY = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"
TIMEOUT_S = 8
MARGIN_S = 20  # the rank's shutdown and torchrun's own teardown on a loaded 2-core machine


def _rank_pids(parent: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes under `parent` (torchrun), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != parent:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = int(entry.name)
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the rank processes in /proc")
def test_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(free_port()), "-m", "unirl.cli", "train", str(TINY),
           "--set", f"logging.run_dir={run}", "--set", "train.rl_steps=1000",
           "--set", "batch.prompts_per_rollout=2", "--set", "batch.samples_per_optimizer_step=16",
           "--set", "batch.micro_batch_size=8", "--set", "logging.tensorboard=false",
           "--set", "progress.enabled=false", "--set", f"parallel.timeout_s={TIMEOUT_S}"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "training did not start in 240 s"
            time.sleep(0.2)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        out, _ = proc.communicate(timeout=TIMEOUT_S + MARGIN_S)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:  # a failure above: leave nothing behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out[-3000:]
    assert took < TIMEOUT_S + MARGIN_S
    assert "unirl: error: rank 0: a collective lost another rank" in out, out[-3000:]
    for pid in ranks.values():  # every rank is gone
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1
