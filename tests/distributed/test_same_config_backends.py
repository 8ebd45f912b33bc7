"""One config, both backends, on the CPU: `unirl train examples/tiny_grpo.yaml` (shrunk to a few
small RL steps) with DeepSpeed in one process, and with ``--set backend=megatron`` in one process
and in two (data parallel, under torchrun, gloo), each in its own subprocess as a user runs it.

From the same seed every run starts from the same weights and samples the same first rollout, so
step 1's loss and gradient norm must agree to 1e-5 (fp32; summation order is the only
difference); later rollouts are sampled from weights that agree to ~1e-7, so the rewards of the
first steps must stay alike.
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from unirl.core.run.metrics_log import read_metrics

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec(name) is None, reason=f"needs {name} (pip install unirl[{extra}])"
    )
    for name, extra in (
        ("deepspeed", "deepspeed"),
        ("megatron", "megatron"),
        ("transformers", "hf"),
    )
]

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo.yaml"
STEPS = 3
SMALL = (
    f"train.rl_steps={STEPS}",
    "batch.prompts_per_rollout=4",
    "batch.samples_per_prompt=4",
    "batch.samples_per_optimizer_step=16",
    "batch.micro_batch_size=4",
    "logging.tensorboard=false",
)
TOL = 1e-5


def _train(tmp_path: Path, name: str, nproc: int, *sets: str) -> list[dict]:
    run_dir = tmp_path / name
    overrides = [*SMALL, f"logging.run_dir={run_dir}", *sets]
    args = ["train", str(EXAMPLE), *[x for o in overrides for x in ("--set", o)]]
    if nproc > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [sys.executable, *launcher, "-m", "unirl.cli", *args]
    else:
        cmd = [sys.executable, "-m", "unirl.cli", *args]
    env_cmd = ["env", "CUDA_VISIBLE_DEVICES=", "OMP_NUM_THREADS=1", *cmd]
    proc = subprocess.run(env_cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-4000:]}"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def deepspeed_run(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("same-config"), "deepspeed", 1)


@pytest.mark.parametrize("nproc", [1, 2])
def test_megatron_trains_like_deepspeed_on_the_cpu(tmp_path, deepspeed_run, nproc):
    megatron = _train(tmp_path, f"megatron-{nproc}", nproc, "backend=megatron")
    ds, mg = deepspeed_run[0], megatron[0]
    assert mg["reward/mean"] == ds["reward/mean"]  # the same first rollout
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert mg[key] == pytest.approx(ds[key], rel=TOL, abs=TOL), key
    rewards = [(m["reward/mean"], d["reward/mean"]) for m, d in zip(megatron, deepspeed_run)]
    assert all(abs(m - d) <= 0.05 for m, d in rewards), rewards
