"""Issue 15, finding 8: the `unirl` command's CPU thread defaults (measured in
benchmarks/cpu_threads.py; the timing itself is too noisy for CI on a shared machine)."""

import subprocess
import sys

from unirl.cpu_threads import apply_cpu_thread_defaults


def test_one_core_left_free_by_default_and_user_settings_win(monkeypatch):
    monkeypatch.setattr("unirl.cpu_threads._cores", lambda: 8)
    env: dict[str, str] = {}
    assert apply_cpu_thread_defaults(env) == {"OMP_NUM_THREADS": "7"}  # 8 cores, one left free
    env = {"LOCAL_WORLD_SIZE": "4"}
    assert apply_cpu_thread_defaults(env) == {"OMP_NUM_THREADS": "1"}  # (8 - 1) // 4 ranks
    monkeypatch.setattr("unirl.cpu_threads._cores", lambda: 2)
    assert apply_cpu_thread_defaults({}) == {"OMP_NUM_THREADS": "1"}
    env = {"OMP_NUM_THREADS": "2"}
    assert apply_cpu_thread_defaults(env) == {} and env == {"OMP_NUM_THREADS": "2"}
    env = {"UNIRL_CPU_THREADS": "off"}
    assert apply_cpu_thread_defaults(env) == {} and env == {"UNIRL_CPU_THREADS": "off"}


def test_the_command_sets_them_before_torch_loads():
    # OpenMP reads its environment once, when torch loads it: `unirl.cli` must not import torch
    code = "import sys, unirl.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
