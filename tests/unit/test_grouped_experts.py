"""`unirl.backends.megatron.moe.grouped_experts`: `GroupedExperts` against a per-expert Python loop
written here (fp64) and against megatron's `SequentialMLP` with the same weights, forward and
gradients of the input, the router probabilities and every expert weight, with experts that get
no token; the selector's choices and reasons; the weight gradients under megatron DDP's
``main_grad`` protocol (emulated, and inside megatron's DDP) against SequentialMLP's summed over
microbatches; `GroupedMoELayer`'s dispatcher against megatron's layer, and that it dispatches
no op that reads a device value back. The CUDA paths: the `gpu` tests. DDP without overlapped
reduction and experts that get no token under DDP: test_grouped_experts_grads.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.spawn import run_distributed

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)

HIDDEN, FFN = 16, 8  # row lengths multiples of 16 bytes in fp32 and bf16 (torch._grouped_mm)


def _config(num_experts: int, dtype: torch.dtype = torch.float32, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        ffn_hidden_size=4 * HIDDEN,
        moe_ffn_hidden_size=FFN,
        num_moe_experts=num_experts,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    return TransformerConfig(**(kwargs | overrides))


def loop_reference(x, tokens_per_expert, probs, fc1, fc2):
    """Qwen3-MoE's expert MLP, one expert at a time in fp64:
    ``(silu(x W_gate^T) * (x W_up^T) * p) W_down^T`` on the rows of each expert."""
    out, start = [], 0
    for e, n in enumerate(tokens_per_expert):
        rows = x[start : start + n].double()
        h = rows @ fc1[e].double().t()
        gate, up = h[:, :FFN], h[:, FFN:]
        a = F.silu(gate) * up * probs[start : start + n].double()[:, None]
        out.append(a @ fc2[e].double().t())
        start += n
    return torch.cat(out)


def _build_pair(num_experts: int, dtype: torch.dtype, device: torch.device, **overrides):
    """SequentialMLP and GroupedExperts with the same weights (loaded by state-dict key)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.spec_utils import build_module

    from unirl.backends.megatron.moe.grouped_experts import (
        ExpertsChoice,
        GroupedExperts,
        experts_spec,
    )

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    config = _config(num_experts, dtype, **overrides)
    pg = get_default_pg_collection()
    sequential = build_module(
        experts_spec(ExpertsChoice(module=_sequential(), name="sequential", reason="test")),
        num_experts,
        config,
        pg_collection=pg,
    )
    grouped = build_module(
        experts_spec(ExpertsChoice(module=GroupedExperts, name="grouped", reason="test")),
        num_experts,
        config,
        pg_collection=pg,
    )
    # same parameter names and shapes as SequentialMLP: its state dict loads as is
    assert sequential.state_dict().keys() == grouped.state_dict().keys()
    grouped.load_state_dict(sequential.state_dict())
    return sequential.to(device), grouped.to(device)


def _sequential():
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP


def _weights(module):
    fc1 = [e.linear_fc1.weight for e in module.local_experts]
    fc2 = [e.linear_fc2.weight for e in module.local_experts]
    return fc1, fc2


def _run(module, x, tokens_per_expert, probs, grad_out):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, torch.tensor(tokens_per_expert), probs)
    assert bias is None
    out.backward(grad_out)
    fc1, fc2 = _weights(module)
    return out.detach(), x.grad, probs.grad, [w.grad for w in fc1], [w.grad for w in fc2]


def _inputs(tokens_per_expert, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_expert)
    x = torch.randn(total, HIDDEN, generator=g).to(device, dtype)
    probs = torch.rand(total, generator=g).to(device)  # megatron's permuted probs are fp32
    grad_out = torch.randn(total, HIDDEN, generator=g).to(device, dtype)
    return x, probs, grad_out


def _reference_grads(x, tokens_per_expert, probs, grad_out, fc1, fc2):
    x64 = x.detach().double().requires_grad_()
    p64 = probs.detach().double().requires_grad_()
    w1 = [w.detach().double().requires_grad_() for w in fc1]
    w2 = [w.detach().double().requires_grad_() for w in fc2]
    ref = loop_reference(x64, tokens_per_expert, p64, w1, w2)
    ref.backward(grad_out.double())
    return ref.detach(), x64.grad, p64.grad, [w.grad for w in w1], [w.grad for w in w2]


def _assert_close(got, ref, tol):
    """Element-wise within ``tol`` of the reference's largest magnitude."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if ref.numel() == 0:
        return
    scale = ref.abs().max().clamp_min(1e-30)
    err = (got.double() - ref.double()).abs().max() / scale
    assert err <= tol, f"max error {err:.3g} of the reference's scale > {tol}"


def _check(rank, world, runs, device_name):
    """Each run: (tokens per expert of each case, fused swiglu, dtype name, tolerance)."""
    for cases, fused, dtype_name, tol in runs:
        _check_run(cases, fused, getattr(torch, dtype_name), torch.device(device_name), tol)
    return True


def _check_run(cases, fused, dtype, device, tol):
    for tokens_per_expert in cases:
        num_experts = len(tokens_per_expert)
        sequential, grouped = _build_pair(num_experts, dtype, device, bias_activation_fusion=fused)
        x, probs, grad_out = _inputs(tokens_per_expert, dtype, device)
        got = _run(grouped, x, tokens_per_expert, probs, grad_out)
        fc1, fc2 = _weights(grouped)
        ref = _reference_grads(x, tokens_per_expert, probs, grad_out, fc1, fc2)
        seq = _run(sequential, x, tokens_per_expert, probs, grad_out)
        for name, g_t, r_t, s_t in zip(("out", "dx", "dprobs"), got[:3], ref[:3], seq[:3]):
            assert g_t.shape == r_t.shape, (name, g_t.shape, r_t.shape)
            _assert_close(g_t, r_t, tol)
            _assert_close(g_t, s_t.double(), tol)
        for e, n in enumerate(tokens_per_expert):
            for g_w, r_w, s_w in (
                (got[3][e], ref[3][e], seq[3][e]),
                (got[4][e], ref[4][e], seq[4][e]),
            ):
                if n == 0:  # an expert with no token: its weights get a zero gradient
                    assert g_w is not None and not g_w.any(), f"expert {e}"
                    continue
                _assert_close(g_w, r_w, tol)
                _assert_close(g_w, s_w.double(), tol)


# tokens per local expert: uneven, with experts that get no token, one expert, no token at all
CPU_CASES = ([3, 0, 5, 1, 0, 7], [4], [0, 0, 0], [2, 9, 0, 6])


def test_grouped_equals_the_loop_and_sequential_mlp_on_the_cpu():
    # fp32 with megatron's unfused and fused (weighted_bias_swiglu_impl) activation; bf16
    # (torch._grouped_mm's CPU fallback takes it) within bf16 rounding (2**-8, twice)
    runs = [
        (CPU_CASES, False, "float32", 1e-5),
        (CPU_CASES, True, "float32", 1e-5),
        (CPU_CASES[:1], False, "bfloat16", 2e-2),
    ]
    assert run_distributed(_check, 1, runs, "cpu") == [True]


def test_unsupported_configs_are_refused_and_left_to_sequential():
    from unirl.backends.megatron.moe.grouped_experts import (
        GroupedExperts,
        select_experts,
        unsupported_reason,
    )
    from unirl.core.errors import ConfigError

    assert unsupported_reason(_config(4)) is None
    assert "biases" in unsupported_reason(_config(4, add_bias_linear=True))
    assert "not SwiGLU" in unsupported_reason(_config(4, activation_func=F.gelu))
    assert "not a multiple of 8" in unsupported_reason(
        _config(4, torch.bfloat16, moe_ffn_hidden_size=12)
    )
    with pytest.raises(ConfigError, match="the experts have biases"):
        GroupedExperts(4, _config(4, add_bias_linear=True), None)
    cuda = torch.device("cuda", 0)  # a device value only: nothing runs on it
    choice = select_experts(cuda, _config(4, add_bias_linear=True))
    assert choice.name == "sequential" and "biases" in choice.reason


def test_megatron_experts_forces_a_module_and_refuses_what_grouped_cannot_compute():
    """``megatron.experts``: grouped on the CPU too (the GPU path's code through torch's
    fallback), sequential on CUDA too; a forced grouped that the config cannot compute is an
    error naming the key, not a silent SequentialMLP."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from unirl.backends.megatron.moe.grouped_experts import GroupedExperts, select_experts
    from unirl.core.errors import ConfigError

    on_cpu = select_experts(torch.device("cpu"), _config(4), "grouped")
    assert on_cpu.module is GroupedExperts and "megatron.experts: grouped" in on_cpu.reason
    on_cuda = select_experts(torch.device("cuda", 0), _config(4), "sequential")
    assert on_cuda.module is SequentialMLP
    with pytest.raises(ConfigError, match=r"megatron.experts: grouped cannot .* biases"):
        select_experts(torch.device("cpu"), _config(4, add_bias_linear=True), "grouped")


def test_selector_picks_sequential_on_the_cpu_and_without_grouped_mm(monkeypatch):
    from megatron.core.transformer.moe.experts import SequentialMLP

    from unirl.backends.megatron.moe.grouped_experts import select_experts

    on_cpu = select_experts(torch.device("cpu"), _config(4))
    assert on_cpu.module is SequentialMLP and "the device is cpu" in on_cpu.reason
    monkeypatch.delattr(torch, "_grouped_mm")
    old_torch = select_experts(torch.device("cuda", 0), _config(4))
    assert old_torch.module is SequentialMLP and "has no torch._grouped_mm" in old_torch.reason


# -- the CUDA path --------------------------------------------------------------------------

# larger and uneven, odd counts and empty experts; bf16 matmuls accumulate in fp32 and round
# their output to bf16 (relative step 2**-8), twice per expert MLP
GPU_CASES = ([1, 0, 17, 64, 3, 0, 100, 5], [0, 256, 0, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_grouped_on_cuda_equals_the_loop_and_sequential_mlp(dtype_name):
    from unirl.backends.megatron.moe.grouped_experts import select_experts

    choice = select_experts(torch.device("cuda", 0), _config(4, getattr(torch, dtype_name)))
    assert choice.name == "grouped", choice.reason
    tol = {"bfloat16": 2e-2, "float32": 1e-4}[dtype_name]  # fp32 matmuls may use TF32
    runs = [(GPU_CASES, False, dtype_name, tol), (GPU_CASES, True, dtype_name, tol)]
    assert run_distributed(_check, 1, runs, "cuda", backend="nccl") == [True]


# -- inside megatron-core's MoELayer ----------------------------------------------------------


def _layer_check(rank, world, device_name, dispatcher, dtype_name, tol):
    """Two megatron-core MoELayers of the local spec, experts SequentialMLP and GroupedExperts,
    same weights: the same output, input gradient and gradient of every parameter (router
    included)."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import router as router_module
    from megatron.core.transformer.spec_utils import build_module

    from unirl.backends.megatron.compat import cpu as cpu_compat
    from unirl.backends.megatron.compat import te as te_compat
    from unirl.backends.megatron.moe.grouped_experts import (
        ExpertsChoice,
        GroupedExperts,
        experts_spec,
    )

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    if device.type == "cpu":
        # router.py:90 moves a CPU router weight to CUDA: a CPU-only line (not what is tested)
        router_module.torch = cpu_compat._HostTorch()
    ps.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    te_compat.install()
    num_experts = 6
    config = _config(
        num_experts,
        dtype,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
    )
    mlp_spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    mlp_spec = mlp_spec.submodules.mlp
    layers = []
    for module in (_sequential(), GroupedExperts):
        choice = ExpertsChoice(module=module, name=module.__name__, reason="test")
        spec = dataclasses.replace(
            mlp_spec,
            submodules=dataclasses.replace(mlp_spec.submodules, experts=experts_spec(choice)),
        )
        torch.manual_seed(0)
        layers.append(build_module(spec, config=config).to(device))
    assert isinstance(layers[1].experts, GroupedExperts)
    layers[1].load_state_dict(layers[0].state_dict())
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 2, HIDDEN, generator=g).to(device, dtype)
    grad_out = torch.randn(11, 2, HIDDEN, generator=g).to(device, dtype)
    results = []
    for layer in layers:
        x_in = x.clone().requires_grad_()
        out, _ = layer(x_in)
        out.backward(grad_out)
        grads = {n: p.grad for n, p in layer.named_parameters()}
        results.append((out.detach(), x_in.grad, grads))
    (out_s, dx_s, grads_s), (out_g, dx_g, grads_g) = results
    _assert_close(out_g, out_s.double(), tol)
    _assert_close(dx_g, dx_s.double(), tol)
    assert grads_s.keys() == grads_g.keys()
    for name, grad in grads_s.items():
        _assert_close(grads_g[name], grad.double(), tol)
    return True


def test_in_a_megatron_moe_layer_the_same_as_sequential_mlp_cpu():
    # the all-to-all dispatcher needs CUDA (a CUDA stream at construction); all-gather here
    assert run_distributed(_layer_check, 1, "cpu", "allgather", "float32", 1e-5) == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_in_a_megatron_moe_layer_the_same_as_sequential_mlp_cuda():
    assert run_distributed(
        _layer_check, 1, "cuda", "alltoall", "bfloat16", 3e-2, backend="nccl"
    ) == [True]


def _moe_spec_experts(rank, world, device_name):
    """The experts module the Qwen3-MoE block spec gets for ``device`` (local spec, no TE)."""
    from megatron.core import parallel_state as ps
    from transformers import Qwen3MoeConfig

    from unirl.backends.megatron.model import moe_block_spec, transformer_config
    from unirl.core.config.run_config import ParallelConfig

    hf = Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=64,
        mlp_only_layers=[0],
    )
    ps.initialize_model_parallel(1, 1)
    config = transformer_config(hf, ParallelConfig(), dtype=torch.bfloat16)
    block = moe_block_spec(config, vp_stage=None, device=torch.device(device_name), use_te=False)
    return [
        spec.submodules.mlp.submodules.experts.module.__name__
        for spec in block.layer_specs
        if hasattr(spec.submodules.mlp.submodules, "experts")
    ]


def test_the_moe_spec_uses_sequential_mlp_on_the_cpu():
    pytest.importorskip("transformers")
    # layer 0 is dense: one sparse layer
    assert run_distributed(_moe_spec_experts, 1, "cpu") == [["SequentialMLP"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_moe_spec_uses_grouped_experts_on_cuda():
    pytest.importorskip("transformers")
    from unirl.backends.megatron.moe.grouped_experts import grouped_mm_available

    if not grouped_mm_available():
        pytest.skip("this torch has no torch._grouped_mm")
    got = run_distributed(_moe_spec_experts, 1, "cuda", backend="nccl")
    assert got == [["GroupedExperts"]]


# -- the gradient into megatron DDP's main_grad --------------------------------------------


def _main_grad_check(rank, world, device_name, dtype_name, tol):
    """`GroupedExperts` under megatron DDP's protocol (each weight with a ``main_grad`` and
    ``grad_added_to_main_grad``, as distributed_data_parallel.py:119 sets them): after two
    microbatches' backward each expert's fp32 ``main_grad`` holds the sum of the two
    microbatches' gradients of the fp64 per-expert loop, its ``.grad`` is a placeholder that
    DDP's hook skips (the flag set), and an expert with no token adds nothing."""
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    counts = [[3, 0, 5, 1, 0, 7, 2, 4, 6, 1, 0, 3, 2, 5, 1, 1, 2, 3], [0, 4] * 9]
    num_experts = len(counts[0])
    _, grouped = _build_pair(num_experts, dtype, device)
    fc1, fc2 = _weights(grouped)
    weights = fc1 + fc2
    for w in weights:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
        w.grad_added_to_main_grad = False
    want = [torch.zeros(w.shape, dtype=torch.float64) for w in weights]
    for seed, tokens_per_expert in enumerate(counts):
        x, probs, grad_out = _inputs(tokens_per_expert, dtype, device, seed=seed + 3)
        ref = _reference_grads(x, tokens_per_expert, probs, grad_out, fc1, fc2)
        for acc, g in zip(want, ref[3] + ref[4]):
            acc += g.cpu()
        out, _ = grouped(x, torch.tensor(tokens_per_expert, device=device), probs)
        out.backward(grad_out)
        for w in weights:
            assert w.grad_added_to_main_grad and w.grad is not None
            assert w.grad.shape == w.shape
            w.grad = None  # what DDP's hook does after reading the flag
    for w, acc in zip(weights, want):
        _assert_close(w.main_grad.cpu(), acc, tol)
    for e in range(num_experts):  # expert 1 has no token in either microbatch
        if counts[0][e] == counts[1][e] == 0:
            assert not fc1[e].main_grad.any() and not fc2[e].main_grad.any()
    return True


def test_weight_gradients_go_into_main_grad_under_megatron_ddp_cpu():
    assert run_distributed(_main_grad_check, 1, "cpu", "float32", 1e-5) == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weight_gradients_go_into_main_grad_under_megatron_ddp_cuda():
    assert run_distributed(_main_grad_check, 1, "cuda", "bfloat16", 3e-2, backend="nccl") == [True]


# -- the all-to-all dispatcher of grouped experts (ep x tp = 1) -----------------------------

# ops that read a device value back to the host (a host sync on CUDA), as dispatched from
# Python; boolean-mask indexing too (it runs nonzero inside its kernel, below the mode)
_SYNCING_OPS = ("nonzero", "masked_select", "_local_scalar_dense", "item", "is_nonzero")
_SYNCING_PREFIXES = ("bincount", "unique", "_unique")


def _bool_indexed(name, args):
    if name not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


def _syncing_ops(fn):
    """Run ``fn`` and return the names of the syncing ops it dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if (
                name in _SYNCING_OPS
                or name.startswith(_SYNCING_PREFIXES)
                or _bool_indexed(name, args)
            ):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_the_syncing_op_record_sees_what_it_looks_for():
    # each of these reads a device value back on CUDA: the record must name it
    x = torch.tensor([0.0, 2.0, 0.0, 3.0])
    cases = [
        (lambda: x[x > 1], "index"),
        (lambda: x.nonzero(), "nonzero"),
        (lambda: torch.bincount(x.long()), "bincount"),
        (lambda: x.sum().item(), "_local_scalar_dense"),
        (lambda: bool((x > 2).any()), "_local_scalar_dense"),  # is_nonzero decomposes
    ]
    for fn, name in cases:
        assert name in _syncing_ops(fn), name
    assert _syncing_ops(lambda: torch.argsort(x, stable=True) % 3) == []


def _layer_pair(device, dtype, num_experts, local_dispatch=True):
    """megatron's MoELayer (its all-to-all dispatcher, SequentialMLP) and `GroupedMoELayer`
    (GroupedExperts), same weights, both with unirl's recording router; ``local_dispatch=False``:
    the second is megatron's MoELayer (its dispatcher) with GroupedExperts."""
    import dataclasses

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from unirl.backends.megatron.compat import cpu as cpu_compat
    from unirl.backends.megatron.compat import te as te_compat
    from unirl.backends.megatron.moe.grouped_dispatch import (
        GroupedMoELayer,
        LocalAlltoAllDispatcher,
    )
    from unirl.backends.megatron.moe.grouped_experts import (
        ExpertsChoice,
        GroupedExperts,
        experts_spec,
    )
    from unirl.backends.megatron.moe.layers import RecordingTopKRouter

    if device.type == "cpu":
        cpu_compat.install()
    ps.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    te_compat.install()
    config = _config(
        num_experts,
        dtype,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
    )
    mlp_spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    mlp_spec = mlp_spec.submodules.mlp
    layers = []
    grouped_cls = GroupedMoELayer if local_dispatch else mlp_spec.module
    for layer_cls, module in ((mlp_spec.module, _sequential()), (grouped_cls, GroupedExperts)):
        choice = ExpertsChoice(module=module, name=module.__name__, reason="test")
        sub = dataclasses.replace(
            mlp_spec.submodules, experts=experts_spec(choice), router=RecordingTopKRouter
        )
        spec = dataclasses.replace(mlp_spec, module=layer_cls, submodules=sub)
        torch.manual_seed(0)
        layers.append(build_module(spec, config=config, layer_number=1).to(device))
    assert type(layers[0].token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    assert isinstance(layers[1].token_dispatcher, LocalAlltoAllDispatcher) == local_dispatch
    assert isinstance(layers[1].experts, GroupedExperts)
    layers[1].load_state_dict(layers[0].state_dict())
    return config, layers


def _dispatch_check(rank, world, device_name, dtype_name, tol):
    """megatron's MoELayer (its all-to-all dispatcher, SequentialMLP) against `GroupedMoELayer`
    (`LocalAlltoAllDispatcher`, GroupedExperts), same weights: the same output, input gradient
    and gradient of every parameter, with free routing and with a replayed routing that gives
    one token an expert twice (the fallback to megatron's permute); the free forward +
    backward of the grouped layer dispatches no op that reads a device value back (megatron's
    does)."""
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    num_experts = 6
    _, layers = _layer_pair(device, dtype, num_experts)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 2, HIDDEN, generator=g).to(device, dtype)
    grad_out = torch.randn(11, 2, HIDDEN, generator=g).to(device, dtype)
    replay = torch.randint(0, num_experts, (22, 2), generator=g)
    replay[5] = torch.tensor([3, 3])  # an expert given twice: that token's row holds one
    replay[7, 1] = (replay[7, 0] + 1) % num_experts
    for given in (None, replay):
        results = [_layer_step(layer, x, grad_out, given) for layer in layers]
        (out_s, dx_s, grads_s, syncs_s), (out_g, dx_g, grads_g, syncs_g) = results
        _assert_close(out_g, out_s.double(), tol)
        _assert_close(dx_g, dx_s.double(), tol)
        assert grads_s.keys() == grads_g.keys()
        for name, grad in grads_s.items():
            _assert_close(grads_g[name], grad.double(), tol)
        if given is None:
            assert syncs_g == [], syncs_g
            assert "masked_select" in syncs_s, syncs_s  # the check can fail
    return True


def _layer_step(layer, x, grad_out, given):
    """One forward + backward of ``layer`` (routing ``given`` replayed, or free): output,
    input gradient, parameter gradients and the syncing ops it dispatched."""
    layer.zero_grad(set_to_none=True)
    layer.router.replay_experts = None if given is None else given.to(x.device)
    x_in = x.clone().requires_grad_()
    outs = []

    def step():
        out, _ = layer(x_in)
        out.backward(grad_out)
        outs.append(out.detach())

    syncs = _syncing_ops(step)
    layer.router.replay_experts = None
    layer.router.recorded_logits = []
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return outs[0], x_in.grad, grads, syncs


def _ddp_check(rank, world, device_name, dtype_name, tol):
    """`GroupedMoELayer` wrapped in megatron's DDP (distributed-optimizer buffers, overlapped
    gradient reduction: every weight must reach DDP's hook), two microbatches: each
    parameter's ``main_grad`` equals the two microbatches' gradients of megatron's plain
    MoELayer with SequentialMLP summed by autograd, and no ``.grad`` is left behind."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    config, (sequential, grouped) = _layer_pair(device, dtype, 18)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True
    )
    ddp = DistributedDataParallel(config, ddp_config, grouped)
    ddp.zero_grad_buffer()
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        x = torch.randn(16, 2, HIDDEN, generator=g).to(device, dtype)
        grad_out = torch.randn(16, 2, HIDDEN, generator=g).to(device, dtype)
        for layer in (sequential, ddp):
            out, _ = layer(x)
            out.backward(grad_out)
        for router in (sequential.router, grouped.router):
            router.recorded_logits = []
    ddp.finish_grad_sync()
    want = dict(sequential.named_parameters())
    for name, param in grouped.named_parameters():
        assert param.grad is None, name
        _assert_close(param.main_grad, want[name].grad.double(), tol)
    return True


def test_grouped_layer_gradients_in_megatron_ddp_main_grad_cpu():
    assert run_distributed(_ddp_check, 1, "cpu", "float32", 1e-5) == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_layer_gradients_in_megatron_ddp_main_grad_cuda():
    assert run_distributed(_ddp_check, 1, "cuda", "bfloat16", 3e-2, backend="nccl") == [True]


def test_grouped_dispatch_equals_megatrons_and_reads_nothing_back_cpu():
    assert run_distributed(_dispatch_check, 1, "cpu", "float32", 1e-5) == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_dispatch_equals_megatrons_and_reads_nothing_back_cuda():
    assert run_distributed(_dispatch_check, 1, "cuda", "bfloat16", 3e-2, backend="nccl") == [True]
