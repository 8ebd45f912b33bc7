"""``optimizer.offload: cpu`` takes AdamW's steps: two optimizer steps of a backend built on the
CPU, with gradients the test writes in, against AdamW written out by hand in float64 (decay on
matrices only, bias-corrected moments), offloaded and not; and the offloaded optimizer's state
really is a host copy (its own tensors, not the parameters).

The offloaded run saves a checkpoint after its first step and resumes from it in a new backend
for the second (the host state is saved by unirl: `unirl.backends.megatron.offload_state`).
A tiny Qwen3-MoE on two ranks under expert parallel 2 runs the same: megatron chains two offloaded
optimizers there (dense and expert parameters; with ep 1 the experts are dense to it), and the
expert one's moments must survive the resume too.
On the CPU the offload is a real copy, not a no-op: the master weights and moments are separate
host tensors that torch's AdamW steps, the gradients are copied in and the weights copied back
(megatron-core's HybridDeviceOptimizer through `unirl.backends.megatron.compat.cpu`; FSDP2's
CPUOffloadPolicy). One process each, gloo.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.distributed.test_megatron_router_losses import HF_CONFIG as ROUTER_HF_CONFIG
from tests.spawn import run_distributed
from tests.tiny_models import TINY_BATCH, TINY_LLAMA

LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
# optimizer.warmup_steps: 4: the steps run at lr x 1/4 and x 2/4 (unirl's schedule writes them
# into the optimizer's groups, which the host optimizer must see; the second after a resume)
LRS = (LR / 4, LR / 2)
HF_CONFIG = {**TINY_LLAMA, "vocab_size": 64, "tie_word_embeddings": False}
# the MoE fixture of the router-loss tests, one layer (two of its 8 experts per token)
MOE_CONFIG = {**ROUTER_HF_CONFIG, "num_hidden_layers": 1}
MODELS = {"llama": HF_CONFIG, "moe": MOE_CONFIG}


def _config(backend: str, offload: str, model: str = "llama", ep: int = 1) -> dict:
    parallel = {"zero_stage": 1, "ep": ep} if backend == "megatron" else {}
    return {
        "backend": backend,
        "model": {"hf_config": dict(MODELS[model]), "init_seed": 3, "max_seq_len": 16},
        "optimizer": {
            "lr": LR,
            "weight_decay": WD,
            "betas": list(BETAS),
            "eps": EPS,
            "grad_clip": None,
            "warmup_steps": 4,
            "offload": offload,
        },
        "batch": dict(TINY_BATCH),
        "parallel": parallel,
        "train": {"seed": 0},
        "logging": {"tensorboard": False},
    }


def _adamw_by_hand(w: torch.Tensor, grads: list[torch.Tensor], wd: float) -> torch.Tensor:
    """torch.optim.AdamW's update, in float64, at the learning rates `LRS`."""
    w = w.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    b1, b2 = BETAS
    for t, (g, lr) in enumerate(zip(grads, LRS), start=1):
        g = g.double()
        w = w * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS)
    return w


def _build(offload: str, model: str, world_size: int) -> tuple:
    from unirl.backends.megatron import build_backend
    from unirl.core.config.run_config import config_from_dict

    ep = world_size if model == "moe" else 1
    cfg = config_from_dict(_config("megatron", offload, model, ep), world_size=world_size)
    backend = build_backend(cfg, total_optimizer_steps=4)
    params = [p for ddp in backend.policy.ddp for p in ddp.module.parameters() if p.requires_grad]
    return backend, params


def _megatron_steps(
    rank: int, world_size: int, offload: str, resume_dir: str | None, model: str
) -> dict:
    """Two optimizer steps with the gradients written into DDP's buffer (what the schedule's
    backward leaves there); with ``resume_dir`` a checkpoint after the first, loaded into a
    newly built backend that takes the second."""
    from unirl.backends.megatron.optimizer import fuse_adam, inner_optimizers

    backend, params = _build(offload, model, world_size)
    out: dict = {"w0": [p.detach().clone() for p in params], "ndim": [p.ndim for p in params]}
    g = torch.Generator().manual_seed(1)
    out["grads"] = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(2)]
    for step, grads in enumerate(out["grads"]):
        if step == 1 and resume_dir is not None:
            backend.save_checkpoint(Path(resume_dir), {})
            backend.close()
            backend, params = _build(offload, model, world_size)
            backend.load_checkpoint(Path(resume_dir))
        for p, grad in zip(params, grads):
            p.main_grad.copy_(grad)
        assert not backend.policy.optimizer_step().skipped
    out["w2"] = [p.detach().clone() for p in params]
    out["how"] = fuse_adam(backend.policy.optimizer)
    from unirl.backends.megatron.compat import cpu as cpu_compat

    # every patched megatron-core line the offload reached is a listed (reviewed) one
    out["unlisted"] = sorted(cpu_compat.reached_lines() - cpu_compat.listed_lines())
    out["reached"] = sorted(cpu_compat.reached_lines())
    inners = inner_optimizers(backend.policy.optimizer)
    out["optimizers"] = len(inners)
    if offload == "cpu":
        # every shard has a host copy of its own (master weights), stepped with its moments
        hosts = [o for inner in inners for o in inner.cpu_optimizers]
        copies = [q for o in hosts for grp in o.param_groups for q in grp["params"]]
        own = {q.data_ptr() for q in copies}
        out["host_copies"] = len(copies)
        out["shares_storage"] = any(p.data_ptr() in own for p in params)
        out["moments"] = sum("exp_avg" in o.state[q] for o in hosts for q in o.state)
    backend.close()
    return out


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.parametrize(
    ("offload", "resume", "model", "optimizers"),
    [
        # the default tier: offloaded steps across a checkpoint resume (the host state is saved
        # by unirl, `unirl.backends.megatron.offload_state`)
        # a MoE under ep 2 (two ranks): two chained offloaded optimizers (dense, expert), both
        # resumed; the dense one is the llama case's
        ("cpu", True, "moe", 2),
        pytest.param("cpu", True, "llama", 1, marks=pytest.mark.slow),
        # the control: the GPU-resident optimizer against the same hand-written AdamW
        pytest.param("none", False, "llama", 1, marks=pytest.mark.slow),
    ],
)
def test_megatron_offloaded_adamw_steps_equal_adamw_by_hand(
    offload, resume, model, optimizers, tmp_path
) -> None:
    resume_dir = str(tmp_path / "ckpt") if resume else None
    world = 2 if model == "moe" else 1
    for out in run_distributed(_megatron_steps, world, offload, resume_dir, model):
        _check(out, offload, optimizers, world)


def _check(out: dict, offload: str, optimizers: int, world: int) -> None:
    """One rank's steps against AdamW by hand, and where its optimizer state lived."""
    assert out["optimizers"] == optimizers
    for w0, w2, ndim, *grads in zip(out["w0"], out["w2"], out["ndim"], *out["grads"]):
        want = _adamw_by_hand(w0, grads, WD if ndim >= 2 else 0.0)
        torch.testing.assert_close(w2.double(), want, rtol=1e-5, atol=1e-6)
    assert out["unlisted"] == []
    if offload == "cpu":
        assert "optimizer/cpu_offloading/hybrid_optimizer.py:273" in out["reached"]
        assert "HybridDeviceOptimizer" in out["how"]
        # one rank: a copy per parameter; two: the dense shard holds part of them
        if world == 1:
            assert out["host_copies"] == len(out["w0"])
        else:
            assert 0 < out["host_copies"] < len(out["w0"])
        assert out["moments"] == out["host_copies"] and not out["shares_storage"]
    else:
        assert "HybridDeviceOptimizer" not in out["how"]
