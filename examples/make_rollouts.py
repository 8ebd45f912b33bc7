"""Write `examples/tiny_rollouts.jsonl`: rollouts of the built-in `reverse_digits` task sampled
with the tiny model of `examples/tiny_grpo.yaml` (random init, seeded), with the sampler's own
per-token log-probs as rollout log-probs. Train on it with

    unirl train examples/tiny_grpo.yaml --rollouts examples/tiny_rollouts.jsonl

Run: python examples/make_rollouts.py [--rollouts N] [--out PATH]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from unirl.core.config.run_config import load_config
from unirl.rollouts import write_task_rollouts

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "tiny_grpo.yaml"))
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "tiny_rollouts.jsonl"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_config(args.config)
    n = write_task_rollouts(args.out, cfg, args.rollouts, args.seed)
    logging.info("wrote %d samples (%d rollouts) to %s", n, args.rollouts, args.out)


if __name__ == "__main__":
    main()
