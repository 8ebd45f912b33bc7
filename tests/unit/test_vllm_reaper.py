"""The vLLM engine's reaper (`unirl.rollouts.vllm.reaper`), in this process with plain `sleep`
processes for the engine's: once its parent is gone it kills the processes it was started for,
and never a process that has since been given one of their PIDs."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil

from unirl.rollouts.vllm import reaper


def test_the_reaper_kills_its_engine_processes_and_no_reused_pid():
    engine = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        # `other` holds a PID the reaper was told of when an earlier process held it (that
        # engine process exited and the PID was given again): its start time is not `other`'s
        earlier = psutil.Process(other.pid).create_time() - 100.0
        argv = [str(-1), *reaper.identities([engine.pid]), f"{other.pid}:{earlier!r}"]
        assert reaper.main(argv) == 0  # parent -1 is not its parent: the owner died
        assert engine.wait(timeout=10) == -9  # killed (SIGKILL)
        assert other.poll() is None  # alive: not the process the reaper was started for
    finally:
        for proc in (engine, other):
            proc.kill()
            proc.wait()


def test_the_reaper_ends_when_its_processes_ended_also_with_their_pid_reused():
    other = subprocess.Popen(["sleep", "60"])
    try:
        earlier = psutil.Process(other.pid).create_time() - 100.0
        # its parent alive (in this process: this process's parent)
        argv = [str(os.getppid()), f"{other.pid}:{earlier!r}"]
        done = threading.Event()
        threading.Thread(target=lambda: done.set() if reaper.main(argv) == 0 else None,
                         daemon=True).start()  # fmt: skip
        assert done.wait(timeout=5)  # none of its processes is alive: it ends, at once
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_the_reaper_outlives_a_ctrl_c_that_its_owner_survives():
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group, the reaper
    included: it keeps watching (its owner decides whether the run ends; should the owner then be
    killed, the engine is still reaped)."""
    engine = subprocess.Popen(["sleep", "60"])
    watcher = reaper.watch([engine.pid])
    try:
        time.sleep(1.0)  # started: Python's own SIGINT handler is installed by then
        watcher.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert watcher.poll() is None
    finally:
        watcher.kill()
        watcher.wait()
        engine.kill()
        engine.wait()
