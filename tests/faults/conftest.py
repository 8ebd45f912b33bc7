"""The fault-injection tier: each test injects one fault into a real `unirl train` job (a
subprocess, on the CPU) and asserts what docs/guides/checkpoints.md promises of it: one ``unirl: error:`` line
naming the cause within a stated bound, no process left behind, the newest checkpoint intact, and
``--resume`` continuing where the run stopped; or, for a fault the job survives, the run finishing.

Leftover processes are found by making this test process a child subreaper
(``PR_SET_CHILD_SUBREAPER``): whatever a job starts and orphans (an engine, a reward worker's
child, a rank) is re-parented here instead of to init, so it shows among this process's
descendants after the job ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import psutil
import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
_PR_SET_CHILD_SUBREAPER = 36


@attrs.frozen
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("unirl: error:")]


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) is not available here")


@pytest.fixture
def job(tmp_path):
    """``job(args, timeout=..., torchrun=N, env=...)`` runs ``unirl <args>`` (or ``python -m
    tests.faults.inject FAULT -- <args>`` through ``fault=``) and returns its `JobResult`; after
    the test, no process the jobs started may be alive."""
    _become_subreaper()
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def run(
        args: list[str],
        *,
        timeout: float = 600,
        torchrun: int = 0,
        fault: str | None = None,
        env: dict[str, str] | None = None,
    ) -> JobResult:
        entry = ["-m", "tests.faults.inject", fault, "--"] if fault else ["-m", "unirl.cli"]
        if torchrun:
            launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                      str(torchrun), "--master_port", str(_free_port()), *entry]  # fmt: skip
        else:
            launch = [sys.executable, *entry]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        t0 = time.monotonic()
        proc = subprocess.run(
            [*launch, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
        )  # fmt: skip
        return JobResult(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)

    yield run
    left = _leftovers(before)
    for p in left:  # do not leak them into the next test
        p.send_signal(signal.SIGKILL)
    assert not left, "processes left after the job: " + ", ".join(
        f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left
    )


def _leftovers(before: set[int], settle_s: float = 10.0) -> list[psutil.Process]:
    """Descendants started by the jobs and still alive after ``settle_s`` (a process killed
    by its parent at exit may need a moment); zombies are reaped, not counted."""
    deadline = time.monotonic() + settle_s
    while True:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)  # reap orphans re-parented here
        alive = [
            p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and _running(p)
        ]  # fmt: skip
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def newest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint of a run that passes its marker's size check (what resume takes)."""
    from unirl.core.run import checkpointing

    found = checkpointing.latest_complete(run_dir / "checkpoints")
    if found is not None:
        assert checkpointing.damage(found[1]) is None, checkpointing.damage(found[1])
    return found


def metric_steps(run_dir: Path) -> list[int]:
    from unirl.core.run.metrics_log import read_metrics

    return [int(r["step"]) for r in read_metrics(run_dir / "metrics.jsonl")]
