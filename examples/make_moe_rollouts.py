"""Write `examples/tiny_qwen3_moe_rollouts.jsonl`: rollouts of the built-in `reverse_digits` task
for the tiny Qwen3-MoE of `examples/tiny_qwen3_moe_replay.yaml`, each sample with the experts the
sampling model routed its tokens to (``routed_experts``), for ``algorithm.routing_replay:
rollout``. Train on it with

    unirl train examples/tiny_qwen3_moe_replay.yaml

The sampling model stands in for a rollout engine whose numerics differ from the trainer's (vLLM's
CPU build cannot return routed experts, see docs/guides/moe.md): the trainer's initial weights (the
config's ``model.init_seed``) with Gaussian noise of ``--router-noise`` x each router weight's
standard deviation added to the router weights only, so that some tokens are routed to other
experts than the trainer's router picks. ``--router-noise 0`` samples with the trainer's weights;
``--dtype bf16`` samples (and routes) with them cast to bf16, an engine that runs in bf16 against
an fp32 trainer.

Run: python examples/make_moe_rollouts.py [--rollouts N] [--router-noise S] [--dtype D] [--out PATH]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from unirl.backends.causal_lm import load_policy
from unirl.core.config.run_config import UnirlConfig, load_config
from unirl.rollouts.routing_capture import moe_routers, write_moe_rollouts

HERE = Path(__file__).parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def engine_model(
    cfg: UnirlConfig, router_noise: float, seed: int, dtype: str = "fp32"
) -> torch.nn.Module:
    """The trainer's initial model (built as the trainer builds it: `load_policy`) with noise on
    its router weights (a seeded generator), in ``dtype``."""
    model = load_policy(cfg.model).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(model):
            w = router.weight
            w += router_noise * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
    return model.to(DTYPES[dtype])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "tiny_qwen3_moe_replay.yaml"))
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--router-noise", type=float, default=0.1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(HERE / "tiny_qwen3_moe_rollouts.jsonl"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    cfg = load_config(args.config)
    model = engine_model(cfg, args.router_noise, args.seed, args.dtype)
    n = write_moe_rollouts(args.out, cfg, args.rollouts, args.seed, hf_model=model)
    logging.info("wrote %d samples (%d rollouts) to %s", n, args.rollouts, args.out)


if __name__ == "__main__":
    main()
