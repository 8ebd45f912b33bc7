"""The metrics reference (`docs/reference/metrics.md`, written by `docs/gen_metrics_reference.py`
from `unirl.core.run.metric_names`): it is current, every key that short real trainings write to
their metrics.jsonl has its entry on the page, and every namespaced metric-name literal in the
code has one too (a metric added without a line fails here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from unirl.core.run.metric_names import METRICS, entry_for

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "reference" / "metrics.md"
NAMESPACES = "reward|response_length|time|throughput|rollout|old_logprobs|critic|eval|episode|router|mismatch|gateway"


def _page_names() -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", PAGE.read_text(), flags=re.M))


def test_the_committed_page_is_current():
    run = subprocess.run(
        [sys.executable, "docs/gen_metrics_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert _page_names() == set(METRICS)


def test_a_real_runs_metric_keys_are_all_documented(tmp_path):
    """Two RL steps of PPO with a critic and a KL penalty (a reference model): step 1 warms the
    critic up alone, step 2 trains both; one run covers the policy's, the critic's, the
    reference's and the rollout's metrics. A fresh process (DeepSpeed keeps process-global
    state, as tests/unit/test_train.py says); about 15 s alone, more under load."""
    run_dir = tmp_path / "run"
    sets = [
        "train.rl_steps=2",
        "critic.warmup_steps=1",
        "algorithm.kl_loss.coef=0.01",
        "batch.prompts_per_rollout=4",  # 2 optimizer steps of 16 samples: a small rollout
        "batch.samples_per_prompt=8",
        "batch.samples_per_optimizer_step=16",
        "batch.micro_batch_size=16",
        f"logging.run_dir={run_dir}",
        "logging.tensorboard=false",
    ]
    argv = [sys.executable, "-m", "unirl.cli", "train", "examples/tiny_ppo.yaml"]
    argv += [a for s in sets for a in ("--set", s)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "UNIRL_PROGRESS": "0"}
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    assert len(rows) == 2 and {"kl", "pg_loss", "critic/value_loss", "critic/warmup"} <= keys
    documented = _page_names()
    assert sorted(k for k in keys if entry_for(k) not in documented) == []


def test_every_namespaced_metric_literal_in_the_code_is_documented():
    """A literal with a placeholder (``f"critic/{k}"``) or cut short (``"eval/pass@"``) must be
    the start of a documented name."""
    literal = re.compile(r'f?"((?:' + NAMESPACES + r')/[^"\s]*)"')
    missing = []
    for path in sorted((ROOT / "unirl").rglob("*.py")):
        for match in literal.finditer(path.read_text()):
            key = match.group(1)
            if entry_for(key) is not None:
                continue
            prefix = key.split("{", 1)[0]
            if not any(name.startswith(prefix) for name in METRICS) or not prefix:
                missing.append(f"{path.relative_to(ROOT)}: {key}")
    assert len(METRICS) >= 60
    assert missing == []
