"""The metrics reference (`docs/reference/metrics.md`, written by `docs/gen_metrics_reference.py`
from `unirl.core.run.metric_names`): it is current, every key that short real trainings write to
their metrics.jsonl has its entry on the page, and every namespaced metric-name literal in the
code has one too (a metric added without a line fails here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from unirl.core.run.metric_names import METRICS, entry_for

ROOT = Path(__file__).parents[2]
PAGE = ROOT / "docs" / "reference" / "metrics.md"
NAMESPACES = "reward|response_length|time|throughput|rollout|old_logprobs|critic|eval|episode|router|mismatch"


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


def test_a_real_runs_metric_keys_are_all_documented(tmp_path, capsys):
    """Two RL steps of PPO with a critic and a KL penalty (a reference model), in this process:
    step 1 warms the critic up alone, step 2 trains both; one run covers the policy's, the
    critic's, the reference's and the rollout's metrics. About 15 s alone, more under load."""
    from unirl.cli import main

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
    argv = ["train", str(ROOT / "examples" / "tiny_ppo.yaml")]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0, capsys.readouterr().err
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
