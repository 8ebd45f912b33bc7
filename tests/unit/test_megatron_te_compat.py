"""`unirl.backends.megatron.compat.te`: without Transformer Engine megatron-core 0.16.1's MoE
router gating raises ``NameError`` on ``te_general_gemm``; after `install()` it runs megatron's
torch branch, checked against the matmul and the top-k routing written out here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)


@pytest.fixture
def unpatched(monkeypatch):
    """moe_utils as megatron-core leaves it without TE (whatever ran before in this process)."""
    from megatron.core.transformer.moe import moe_utils

    from unirl.backends.megatron.compat import te as te_compat

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed: megatron-core binds te_general_gemm")
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(te_compat, "_installed", False)
    return moe_utils


def test_listed_lines_read_the_name_in_the_installed_megatron_core():
    import megatron.core
    from megatron.core import package_info

    from unirl.backends.megatron.compat import te as te_compat

    assert package_info.__version__ in te_compat.CHECKED_VERSIONS
    root = Path(megatron.core.__file__).parent
    for patch in te_compat.PATCHES:
        for where in patch.lines:
            path, number = where.rsplit(":", 1)
            code = (root / path).read_text().splitlines()[int(number) - 1]
            assert f"{patch.name} is not None" in code, f"{where}: {code!r}"


def test_router_gating_fails_without_the_patch_and_matches_the_matmul_with_it(unpatched):
    from unirl.backends.megatron.compat import te as te_compat

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 8, generator=g, requires_grad=True)
    with pytest.raises(NameError, match="te_general_gemm"):
        unpatched.router_gating_linear(x, w, None, torch.float32)

    te_compat.install()
    assert unpatched.te_general_gemm is None
    logits = unpatched.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(logits, torch.einsum("sbh,eh->sbe", x, w))
    grad = torch.randn(2, 3, 4, generator=g)
    logits.backward(grad)
    # d/dx = grad @ W, d/dW = sum over tokens of grad^T x
    torch.testing.assert_close(x.grad, torch.einsum("sbe,eh->sbh", grad, w))
    torch.testing.assert_close(w.grad, torch.einsum("sbe,sbh->eh", grad, x))
    te_compat.install()  # idempotent


def test_nothing_to_do_where_te_imported(unpatched, monkeypatch):
    from unirl.backends.megatron.compat import te as te_compat

    monkeypatch.setattr(unpatched, "HAVE_TE", True)
    te_compat.install()
    assert "te_general_gemm" not in vars(unpatched)


def test_refuses_an_unchecked_megatron_version(unpatched, monkeypatch):
    from megatron.core import package_info

    from unirl.backends.megatron.compat import te as te_compat

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"found megatron-core 0\.17\.0: install megatron-core"):
        te_compat.install()


def _router_forward(rank, world):
    """megatron's TopKRouter on the CPU: NameError before `install()`, the top-k routing of
    the gating logits after (softmax over the k largest logits, Qwen3-MoE's renormalised
    weights)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import router as router_module
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    from unirl.backends.megatron.compat import cpu as cpu_compat

    # router.py:90 moves a CPU router weight to CUDA: a CPU-only line, stood in for here as
    from unirl.backends.megatron.compat import te as te_compat

    # cpu_compat does for its listed lines (the patch under test is the TE one)
    router_module.torch = cpu_compat._HostTorch()
    ps.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        num_moe_experts=6,
        moe_router_topk=2,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        add_bias_linear=False,
    )
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    x = torch.randn(5, 1, 8, generator=torch.Generator().manual_seed(1))
    try:
        router(x)
    except NameError as e:
        assert "te_general_gemm" in str(e)
    else:
        raise AssertionError("the router ran without the patch: is the patch still needed?")
    te_compat.install()
    probs, routing_map = router(x)

    logits = x.reshape(5, 8) @ router.weight.detach().t()
    top_values, top_idx = torch.topk(logits, 2, dim=-1)
    ref_probs = torch.zeros(5, 6).scatter(1, top_idx, torch.softmax(top_values, dim=-1))
    torch.testing.assert_close(probs.detach(), ref_probs)
    assert torch.equal(routing_map, ref_probs > 0)
    return True


def test_megatron_router_forward_on_the_cpu_fails_before_and_runs_after():
    assert run_distributed(_router_forward, 1) == [True]
