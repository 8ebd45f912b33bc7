"""`GroupedExperts`' weight gradients under megatron-core's DDP, against megatron's own layer
(MoELayer with its all-to-all dispatcher and SequentialMLP) wrapped in the same DDP config:
after every microbatch each parameter's ``main_grad`` (every expert's and the router's) equals
the reference's, with ``overlap_grad_reduce`` off (what `unirl.backends.megatron.optimizer.
wrap_ddp` builds) and on; and experts that a microbatch routes no token to keep their
``main_grad`` bit for bit (zero until they get a token), through megatron's MoELayer and
through `GroupedMoELayer`. fp32 on the CPU over gloo."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.spawn import run_distributed
from tests.unit.test_grouped_experts import HIDDEN, _assert_close, _layer_pair

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)

NUM_EXPERTS = 6
STARVED = (0, NUM_EXPERTS - 1)  # the experts a "starved" microbatch routes no token to


def _starve_router(layer):
    """Router rows of the `STARVED` experts: -4 on hidden feature 0, so a token whose feature 0
    is above 3 gives them logits below -12 and the others (init std 0.02) win its top-2."""
    with torch.no_grad():
        for e in STARVED:
            layer.router.weight[e, 0] = -4.0


def _microbatch(kind, g):
    x = torch.randn(16, 2, HIDDEN, generator=g)
    if kind == "starved":
        x[..., 0] = 3.0 + x[..., 0].abs()
    return x, torch.randn(16, 2, HIDDEN, generator=g)


def _assert_main_grad(name, got, want, tol):
    try:
        _assert_close(got, want.double(), tol)
    except AssertionError as err:
        raise AssertionError(f"{name}: {err}") from None


def _ddp_grads_check(rank, world, kinds, overlap, distributed, local_dispatch, tol):
    """Both layers in megatron's DDP (``overlap_grad_reduce=overlap``, the distributed
    optimizer's buffers when ``distributed``); for each microbatch of ``kinds`` ("free":
    routed by the router as built, every expert gets a token; "starved": `STARVED` get none)
    one forward + backward of each, then every ``main_grad`` of the grouped layer against the
    reference's; a starved expert's ``main_grad`` equals exactly what it was before."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cpu = torch.device("cpu")
    config, layers = _layer_pair(cpu, torch.float32, NUM_EXPERTS, local_dispatch)
    if "starved" in kinds:
        for layer in layers:
            _starve_router(layer)
    routed = []  # tokens per expert of each forward, as the grouped experts got them
    layers[1].experts.register_forward_pre_hook(
        lambda _, args: routed.append(torch.as_tensor(args[1]).clone())
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=distributed,
    )
    ddps = [DistributedDataParallel(config, ddp_config, layer) for layer in layers]
    for ddp in ddps:
        ddp.zero_grad_buffer()
    want, got = (dict(layer.named_parameters()) for layer in layers)
    assert want.keys() == got.keys()
    starved_names = [n for n in got for e in STARVED if n.startswith(f"experts.local_experts.{e}.")]
    assert len(starved_names) == 2 * len(STARVED), starved_names  # fc1 and fc2 of each
    g = torch.Generator().manual_seed(5)
    for kind in kinds:
        before = {n: got[n].main_grad.clone() for n in starved_names}
        x, grad_out = _microbatch(kind, g)
        for ddp in ddps:
            out, _ = ddp(x)
            out.backward(grad_out)
        for layer in layers:
            layer.router.recorded_logits = []
        tokens = routed[-1]
        if kind == "starved":
            assert tokens[list(STARVED)].tolist() == [0] * len(STARVED), tokens
            for n in starved_names:
                assert torch.equal(got[n].main_grad, before[n]), (kind, n)
        else:
            assert (tokens > 0).all(), tokens  # every expert's gradient is compared
        for name, param in got.items():
            assert param.grad is None, name  # DDP's hook took it
            _assert_main_grad(name, param.main_grad, want[name].main_grad, tol)
    for ddp in ddps:
        ddp.finish_grad_sync()
    for name, param in got.items():
        _assert_main_grad(name, param.main_grad, want[name].main_grad, tol)
    return True


@pytest.mark.parametrize("distributed", [False, True], ids=["ddp", "distributed_optimizer"])
def test_main_grad_without_overlapped_reduction_equals_megatrons_layer(distributed):
    # wrap_ddp's config (overlap_grad_reduce=False); the overlapped one: test_grouped_experts
    kinds = ["free", "free"]
    assert run_distributed(_ddp_grads_check, 1, kinds, False, distributed, True, 1e-5) == [True]


@pytest.mark.parametrize("local_dispatch", [True, False], ids=["GroupedMoELayer", "MoELayer"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync_reduce", "overlap_reduce"])
def test_experts_without_tokens_keep_their_main_grad(overlap, local_dispatch):
    # zero through two starved microbatches, nonzero after a free one, then unchanged again
    kinds = ["starved", "starved", "free", "starved"]
    got = run_distributed(_ddp_grads_check, 1, kinds, overlap, False, local_dispatch, 1e-5)
    assert got == [True]
