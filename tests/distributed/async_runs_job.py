"""Several `unirl train` runs in one torchrun launch, for tests/distributed/test_async_ranks.py.

    torchrun --nproc_per_node 2 tests/distributed/async_runs_job.py SPEC.json

``SPEC.json``: ``{"config": path, "out": dir, "runs": [{"name", "sets", "resume"}]}``. The
default process group is made here, so each run's backend joins it and leaves it up for the
next run (one launch instead of one per run: the test's cost is the process start). Every rank
writes ``out/NAME.rank{R}.json`` with its own last metrics: the rollout each rank trained on
must be the same on every rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from unirl.core.config.run_config import load_config
from unirl.train import train


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for run in spec["runs"]:
            cfg = load_config(spec["config"], run["sets"])
            summary = train(cfg, resume=run["resume"])
            out = Path(spec["out"]) / f"{run['name']}.rank{rank}.json"
            out.write_text(json.dumps(summary.last_metrics))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # vLLM spawns its processes: they re-import this script
    main()
