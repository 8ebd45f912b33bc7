"""``unirl train examples/tiny_agent.yaml``: the example agent (an ordinary ``openai``-SDK
program, examples/tiny_agent.py) trained through the gateway on the CPU.

- two steps, synchronous and with rollouts generated one step ahead (``train.max_staleness:
  1``, `RolloutsAhead` around the agent source): the run ends cleanly (no gateway, agent or
  engine thread left behind in the process), logs the gateway's metrics, and the rollouts the
  worker generated ahead are one policy version old;
- (slow) the policy learns the tool: from about 0.03 (a guess, without the tool, is right 1 in
  10) the mean reward of the last 10 of 300 steps reaches 0.5, synchronous and with k = 1.
  Measured (benchmarks/results/tiny_agent/): 10-step means of 0.5 by step 158 and 0.9 by 197
  (synchronous, 300 steps), 0.5 by 270 and 0.73 over the last 10 (k = 1); earlier runs passed 0.5 at 124, at 167 (k = 1), or were still at
  0.23 after 200 steps (the plateau at 0.2 varies), hence 300 steps here.
"""

from __future__ import annotations

import threading

import pytest

from unirl.cli import main
from unirl.core.run.metrics_log import read_metrics

EXAMPLE = "examples/tiny_agent.yaml"
SMALL = ["batch.prompts_per_rollout=4", "batch.samples_per_prompt=4",
         "batch.samples_per_optimizer_step=16", "batch.micro_batch_size=16",
         "checkpoint.export_hf=false"]  # fmt: skip


def _train(tmp_path, *sets: str) -> list[dict]:
    run = tmp_path / "run"
    args = ["train", EXAMPLE, "--set", f"logging.run_dir={run}"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    return read_metrics(run / "metrics.jsonl")


@pytest.mark.parametrize("staleness", [0, 1])
def test_tiny_agent_trains_through_the_gateway(tmp_path, staleness):
    before = {t.name for t in threading.enumerate()}
    rows = _train(tmp_path, "train.rl_steps=2", f"train.max_staleness={staleness}", *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["gateway/failed_episodes"] == 0 and r["gateway/late_calls"] == 0
        assert 1 <= r["gateway/calls_per_episode"] <= 3
    assert rows[1]["rollout/staleness"] == staleness
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not {n for n in left if n.startswith(("unirl-gateway", "unirl-agent"))}, left


@pytest.mark.slow  # 300 steps (~10 minutes on 2 shared cores); the test above runs by default
@pytest.mark.parametrize("staleness", [0, 1])
def test_tiny_agent_learns_the_tool(tmp_path, staleness):
    rows = _train(tmp_path, "train.rl_steps=300", f"train.max_staleness={staleness}",
                  "checkpoint.export_hf=false")  # fmt: skip
    first = rows[0]["reward/mean"]
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert first < 0.15 and last >= 0.5, (first, last)


def test_the_guides_agent_is_the_examples():
    """docs/guides/agents.md shows examples/tiny_agent.py's agent function as it is."""
    from pathlib import Path

    from tests.unit.doc_snippets import doc_snippet

    assert doc_snippet("guides/agents.md", "agent") in Path("examples/tiny_agent.py").read_text()


def test_the_readmes_agent_loop_is_the_examples():
    """The README's few lines on agents: the example's signature and its call, the config its
    command trains naming that function; the `agent` extra holds what the loop imports."""
    import re
    from pathlib import Path

    import tomllib
    import yaml

    readme = Path("README.md").read_text()
    example = Path("examples/tiny_agent.py").read_text()
    (shown,) = re.findall(r"```python\n(def agent.*?)```", readme, re.S)
    assert (
        "def agent(base_url: str, task: dict" in shown
        and "def agent(base_url: str, task: dict" in example
    )
    assert 'client.chat.completions.create(model="policy", messages=' in example
    assert "`unirl train examples/tiny_agent.yaml`" in readme
    cfg = yaml.safe_load(Path("examples/tiny_agent.yaml").read_text())
    assert cfg["rollout"]["agent"]["function"] == "examples/tiny_agent.py:agent"
    extras = tomllib.loads(Path("pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {re.split(r"[<>=]", d)[0] for d in extras["agent"]} == {"fastapi", "uvicorn", "openai"}
