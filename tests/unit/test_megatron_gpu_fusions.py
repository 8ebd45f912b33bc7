"""The Triton packed RoPE and SwiGLU backward that replace megatron-core's unfused functions on
CUDA (`unirl.backends.megatron.kernels.gpu_fusions`): the frequency rows and cos / sin tables against
megatron's own per-sequence construction on the CPU, the CPU left on megatron's code, and on a
GPU the kernels against megatron's unfused RoPE (bf16: bit for bit) and eager SwiGLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install unirl[megatron])")

import itertools

from megatron.core.fusions import fused_bias_swiglu
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import TransformerConfig

from unirl.backends.megatron.kernels import fused_rmsnorm, fused_rope, fused_swiglu, gpu_fusions

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)")


FakeGroup = gpu_fusions.CPGroupShape


def rope_freqs(rows: int, dim: int) -> torch.Tensor:
    inv = 1.0 / (1_000_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]  # megatron's RotaryEmbedding layout


def megatron_packed_freqs(cu: list[int], freqs: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """megatron's own construction (`_get_thd_freqs_on_this_cp_rank`, one sequence at a time)."""
    offsets = freqs.shape[0] == cu[-1]
    parts = []
    for start, end in itertools.pairwise(cu):
        x = torch.empty((end - start) // cp)
        offset = start if offsets else 0
        parts.append(rope_utils._get_thd_freqs_on_this_cp_rank(rank, cp, x, freqs, offset))
    return torch.cat(parts)


def test_freq_rows_by_hand():
    # cp=2, rank 0: a 4-token sequence keeps chunk 0 of 4 ([0]) and chunk 3 ([3]); an 8-token
    # one keeps [0, 1] and [6, 7]
    assert fused_rope.thd_freq_rows([0, 4, 12], cp_size=2, cp_rank=0, offsets=False).tolist() == [
        0,
        3,
        0,
        1,
        6,
        7,
    ]
    # rank 1 keeps the middle chunks; with offsets the second sequence starts at row 4
    assert fused_rope.thd_freq_rows([0, 4, 12], cp_size=2, cp_rank=1, offsets=True).tolist() == [
        1,
        2,
        6,
        7,
        8,
        9,
    ]
    assert fused_rope.thd_freq_rows([0, 3, 5], cp_size=1, cp_rank=0, offsets=False).tolist() == [
        0,
        1,
        2,
        0,
        1,
    ]


@pytest.mark.parametrize(
    ("cu", "cp", "rank", "rows"),
    [
        ([0, 7, 20, 21, 64], 1, 0, 64),
        ([0, 8, 24, 28, 64], 2, 1, 64),
        ([0, 16, 48, 64], 4, 2, 64),
        ([0, 8, 24, 28, 64], 2, 0, 64),  # freqs of the batch's length: megatron's offset mode
    ],
)
def test_tables_match_megatrons_per_sequence_construction(cu, cp, rank, rows):
    freqs = rope_freqs(rows, 16)
    want = megatron_packed_freqs(cu, freqs, cp, rank)  # [T, 1, 1, D]
    got_rows = fused_rope.thd_freq_rows(cu, cp_size=cp, cp_rank=rank, offsets=rows == cu[-1])
    cos, sin = fused_rope.rope_tables(freqs, got_rows, torch.bfloat16, 1.0)
    assert torch.equal(cos, torch.cos(want[:, 0, 0]).to(torch.bfloat16))
    assert torch.equal(sin, torch.sin(want[:, 0, 0]).to(torch.bfloat16))


def test_tables_built_once_per_microbatch_and_checked():
    freqs = rope_freqs(32, 8)
    a = fused_rope._cached_tables(freqs, [0, 5, 12], 1, 0, torch.float32, 1.0, 12)
    b = fused_rope._cached_tables(freqs, [0, 5, 12], 1, 0, torch.float32, 1.0, 12)
    assert a[0] is b[0] and a[1] is b[1]  # q, k and every layer share the tables
    c = fused_rope._cached_tables(freqs, [0, 6, 12], 1, 0, torch.float32, 1.0, 12)
    assert c[0] is not a[0]
    with pytest.raises(ValueError, match="give 12 tokens on context-parallel rank 0 of 1"):
        fused_rope._cached_tables(freqs, [0, 5, 12], 1, 0, torch.float32, 2.0, 10)


def test_cpu_keeps_megatron_functions(monkeypatch):
    monkeypatch.setattr(gpu_fusions, "_state", {"installed": None, "why": None, "probed": set()})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from megatron.core.tensor_parallel import layers

    def names():
        return (
            rope_utils._apply_rotary_pos_emb_thd,
            fused_bias_swiglu.swiglu_back,
            layers.LinearWithGradAccumulationAndAsyncCommunication,
            layers.LinearWithFrozenWeight,
        )

    before = names()
    assert gpu_fusions.install() is False
    assert names() == before
    norm = torch.nn.Sequential(torch.nn.RMSNorm(8))
    assert gpu_fusions.convert(norm) == 0 and type(norm[0]) is torch.nn.RMSNorm
    assert gpu_fusions.refusal() == "no CUDA device"
    assert gpu_fusions.status() == "off: no CUDA device"
    t = torch.zeros(4, 2, 8)
    assert "not on a CUDA device" in fused_rope.fused_path_refusal(
        t, rope_freqs(4, 8), False, False
    )


def test_patch_lines_call_the_patched_names():
    """Each listed megatron-core line calls the name its patch replaces."""
    import pathlib

    import megatron.core

    root = pathlib.Path(megatron.core.__file__).parent
    for patch in gpu_fusions.PATCHES:
        for line in patch.lines:
            path, number = line.rsplit(":", 1)
            text = (root / path).read_text().splitlines()[int(number) - 1]
            assert f"{patch.name}(" in text or f"{patch.name}.apply(" in text, (line, text)


def test_kernels_in_the_triton_interpreter():
    """The Triton kernels' maths on the CPU (Triton's interpreter, in a subprocess: it must be
    on before the kernels are decorated): bf16 and fp32 RoPE bit for bit megatron's, context
    parallel and a strided input included, and the SwiGLU gradient against float64. About 5 s."""
    pytest.importorskip("triton", reason="needs Triton (its interpreter runs the kernels)")
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).with_name("triton_interpret_fusions.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("identical forward and gradient") == 4, done.stdout
    assert "swiglu_back fp32: matches float64 autograd" in done.stdout
    assert done.stdout.count(": matches float64 autograd") == 4, done.stdout  # + 3 RMSNorms
    assert done.stdout.count(": passes") == 2, done.stdout  # the install probe's code
    assert "probe with a wrong kernel installed: refuses" in done.stdout


# --- on a GPU -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed():
    why = gpu_fusions.refusal()
    if why is not None:
        pytest.skip(f"fusions off: {why}")
    # on CUDA with Triton the install probe must pass (it compares with megatron's functions)
    assert gpu_fusions.install(), gpu_fusions.status()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels)")
def test_training_shapes_take_the_triton_path(installed, monkeypatch):
    """At the 1.5B benchmark's shapes (head dim 128, 12 query / 2 key-value heads, k a strided
    view of the fused qkv) the call runs the kernel, not megatron's function it falls back to:
    a comparison with megatron would otherwise compare megatron with itself."""

    def refuse(*args, **kwargs):
        raise AssertionError("fell back to megatron's unfused RoPE")

    cu = torch.tensor([0, 1000, 4096], dtype=torch.int32, device="cuda")
    freqs = rope_freqs(4096, 128).to("cuda")
    with monkeypatch.context() as patch:
        patch.setitem(fused_rope.ORIGINAL, "_apply_rotary_pos_emb_thd", refuse)
        for heads in (12, 2):
            wide = torch.randn(4096, heads, 256, device="cuda", dtype=torch.bfloat16)
            out = fused_rope.apply_rotary_pos_emb_thd(
                wide[..., :128], cu, freqs, cp_group=gpu_fusions.CPGroupShape()
            )
            assert out.shape == (4096, heads, 128)
    # the probe at these shapes compares the kernel with megatron's own function (restored here:
    # with the refusal still in place the probe's reference itself would raise)
    assert gpu_fusions.probe(torch.device("cuda"), gpu_fusions.ProbeShape(128, (2, 12))) is None


def _megatron_rope(t, cu, freqs, group):
    return fused_rope.ORIGINAL["_apply_rotary_pos_emb_thd"](t, cu, freqs, cp_group=group)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cp", [1, 2])
def test_rope_matches_megatron_unfused(installed, dtype, cp):
    gen = torch.Generator().manual_seed(cp)
    lengths = [cp * 2 * n for n in (700, 1, 1523, 96, 2)]  # multiples of 2 cp
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    tokens, dim, groups, per_group = int(cu[-1]) // cp, 128, 2, 6
    freqs = rope_freqs(max(lengths), dim).cuda()
    group = FakeGroup(cp, cp - 1)
    qkv = torch.randn(tokens, groups, (per_group + 2) * dim, generator=gen).to("cuda", dtype)
    grads = [torch.randn(tokens, h, dim, generator=gen).to("cuda", dtype) for h in (12, 2)]
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)

    def rotated(rope):
        """q (a copy, as megatron reshapes it) and k (a strided view of the fused qkv, as
        megatron splits it) rotated by ``rope``; the outputs and the gradient of the qkv."""
        base = qkv.detach().clone().requires_grad_()
        q = base[..., : per_group * dim].reshape(tokens, groups * per_group, dim)
        k = base[..., per_group * dim : (per_group + 1) * dim]
        outs = [rope(t) for t in (q, k)]
        (grad,) = torch.autograd.grad(outs, base, grads)
        return outs, grad

    want, want_grad = rotated(lambda t: _megatron_rope(t, cu, freqs, group))
    # through megatron's own entry point: the patch is what it calls
    got, got_grad = rotated(
        lambda t: rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=group)
    )
    if dtype == torch.bfloat16:
        # each product rounded to bf16 before the sum, as megatron's eager ops: identical
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(got_grad, want_grad)
    else:
        # fp32: a fused multiply-add may round once instead of twice (|t| < 6, ulp 5e-7)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=2e-6)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_back_matches_eager(installed, dtype):
    gen = torch.Generator().manual_seed(1)
    rows, width = 3000, 1100  # width not a multiple of the kernel's block
    y = (3 * torch.randn(rows, 2 * width, generator=gen)).to("cuda", dtype)
    g = torch.randn(rows, width, generator=gen).to("cuda", dtype)
    # eager autograd of silu(y1) * y2, in fp32 from the same (rounded) inputs
    y32 = y.float().requires_grad_()
    y1, y2 = y32.chunk(2, dim=-1)
    (want,) = torch.autograd.grad(F.silu(y1) * y2, y32, g.float())
    got = fused_swiglu.swiglu_back(g, y)
    assert got.dtype == dtype and got.shape == y.shape
    if dtype == torch.float32:
        # another sigmoid: a few ulp of the gradient's scale (|y| < 15, so up to ~30)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        # fp32 maths, one rounding at the store: within one bf16 ulp of the fp32 gradient
        assert ((got.float() - want).abs() <= want.abs() * 2.0**-7 + 1e-30).all()
    # megatron's autograd function calls it (the patch), with its result
    y_in = y.detach().clone().requires_grad_()
    out = fused_bias_swiglu.bias_swiglu_impl(y_in, None)
    (via_megatron,) = torch.autograd.grad(out, y_in, g)
    assert torch.equal(via_megatron, got)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("width", [1536, 128, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_matches_torch_on_cuda(installed, width, dtype):
    """The converted norm at the benchmark's widths (hidden 1,536; Qwen3's q / k norms over 128)
    against float64, no further from it than torch's RMSNorm, and the Triton path taken."""
    gen = torch.Generator().manual_seed(5)
    x = (2 * torch.randn(4099, 1, width, generator=gen)).to("cuda", dtype)
    dy = torch.randn(4099, 1, width, generator=gen).to("cuda", dtype)
    ref = torch.nn.RMSNorm(width, eps=1e-6, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(width, generator=gen))
    model = torch.nn.Sequential(torch.nn.RMSNorm(width, eps=1e-6, device="cuda", dtype=dtype))
    model[0].load_state_dict(ref.state_dict())
    assert gpu_fusions.convert(model) == 1
    assert fused_rmsnorm.fused_path_refusal(x, model[0]) is None
    x64 = x.double().requires_grad_()
    w64 = ref.weight.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64
    want = (y64, *torch.autograd.grad(y64, (x64, w64), dy.double()))
    errors = []
    for norm in (ref, model[0]):
        xx = x.clone().requires_grad_()
        y = norm(xx)
        got = (y, *torch.autograd.grad(y, (xx, norm.weight), dy))
        errors.append(
            [float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want)]
        )
    torch_err, ours = errors
    for name, a, b in zip(("output", "dx", "dweight"), torch_err, ours):
        assert b <= 2 * a + 1e-6, (name, a, b)
