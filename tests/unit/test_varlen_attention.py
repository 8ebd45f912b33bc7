"""Packed causal attention against an explicit fp64 softmax per sequence, written here.

Sequences of lengths 1, 3 and 8 (plus an empty one), GQA with 4 query heads over 2 key/value
heads. The flash (varlen) path is checked on a GPU when there is one; on the CPU its query/key
segment bookkeeping is checked with a bottom-right-causal kernel written in this file.
"""

from __future__ import annotations

import math

import pytest
import torch

from unirl.backends.megatron.kernels import varlen_attention as va
from unirl.core.data.context_parallel import CPLayout
from unirl.core.errors import LossInputError

LENGTHS = [1, 3, 0, 8]
HQ, HKV, D = 4, 2, 8


def reference(q, k, v, lengths, scale=None):
    """Per sequence: softmax(Q K^T * scale + causal mask) V in fp64; kv head of query head h is
    h // (HQ / HKV)."""
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].double() for t in (q, k, v))
        group = qs.shape[1] // ks.shape[1]
        heads = []
        for h in range(qs.shape[1]):
            kh, vh = ks[:, h // group], vs[:, h // group]
            s = qs[:, h] @ kh.T * (scale if scale is not None else 1 / math.sqrt(qs.shape[-1]))
            allowed = torch.arange(n)[None, :] <= torch.arange(n)[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(s, dim=-1) @ vh)
        if n:
            outs.append(torch.stack(heads, dim=1))
        start += n
    return torch.cat(outs)


def make_qkv(lengths, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(total, HKV, D, generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def forward_backward(fn, q, k, v, grad_out):
    out = fn(q, k, v)
    out.backward(grad_out)
    return out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


@pytest.mark.parametrize("scale", [None, 0.3])
def test_packed_matches_fp64_reference(scale):
    q, k, v = make_qkv(LENGTHS)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(sum(LENGTHS), HQ, D, dtype=torch.float64)
    out, grads = forward_backward(
        lambda a, b, c: va.packed_causal_attention(a, b, c, cu_of(LENGTHS), scale=scale),
        q,
        k,
        v,
        grad_out,
    )
    ref, ref_grads = forward_backward(
        lambda a, b, c: reference(a, b, c, LENGTHS, scale), qr, kr, vr, grad_out
    )
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_single_token_sequence_returns_its_value():
    # a 1-token sequence attends to itself only: softmax over one key = 1, so out = v (per group)
    q, k, v = make_qkv([1])
    out = va.packed_causal_attention(q, k, v, cu_of([1]))
    torch.testing.assert_close(out[0, 0], v[0, 0].detach())
    torch.testing.assert_close(out[0, 1], v[0, 0].detach())  # heads 0, 1 share kv head 0
    torch.testing.assert_close(out[0, 3], v[0, 1].detach())


def test_packing_metadata_matches_loop():
    cu = cu_of(LENGTHS)
    want = []
    for n in LENGTHS:
        want.extend(range(n))
    assert va.packed_position_ids(cu).tolist() == want
    assert va.max_seqlen(cu) == max(LENGTHS)
    assert va.max_seqlen(torch.tensor([0])) == 0


def test_cp_attention_index_matches_loop():
    # lengths 1, 3, 8 with cp=2 pad to 4, 4, 8: chunks of 1, 1, 2 tokens.
    cu = cu_of([1, 3, 8])
    padded_starts, cp = [0, 4, 8], 2
    # rank 0 holds chunks 0 and 3: key prefixes end at 1*c and 4*c; rank 1 (chunks 1, 2): 2c, 3c
    want_k = {0: [1, 4, 1, 4, 2, 8], 1: [2, 3, 2, 3, 4, 6]}
    for r in range(cp):
        idx = va.CPAttentionIndex.build(CPLayout.build(cu, cp, r))
        assert idx.cu_q.tolist() == [0, 1, 2, 3, 4, 6, 8]
        assert idx.cu_k.diff().tolist() == want_k[r]
        keys = []
        for s, start in enumerate(padded_starts):
            for end in want_k[r][2 * s : 2 * s + 2]:
                keys.extend(range(start, start + end))
        assert idx.key_index.tolist() == keys
        assert (idx.max_q, idx.max_k) == (2, max(want_k[r]))
    # rank-major all-gather: rank 0 holds padded positions [0,3, 4,7, 8,9,14,15], rank 1
    # [1,2, 5,6, 10,11,12,13]; gather_order[p] = row of position p in that concatenation
    gathered = [0, 3, 4, 7, 8, 9, 14, 15, 1, 2, 5, 6, 10, 11, 12, 13]
    order = va.CPAttentionIndex.build(CPLayout.build(cu, cp, 0)).gather_order
    assert [gathered[i] for i in order.tolist()] == list(range(16))


def bottom_right_causal_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Stand-in for flash's varlen kernel on the CPU: segment i's query j attends to its keys
    0 .. len_k - len_q + j (causal aligned to the bottom right, as flash does)."""
    outs = []
    for i in range(cu_q.numel() - 1):
        qs = q[int(cu_q[i]) : int(cu_q[i + 1])]
        ks, vs = k[int(cu_k[i]) : int(cu_k[i + 1])], v[int(cu_k[i]) : int(cu_k[i + 1])]
        nq, nk = qs.shape[0], ks.shape[0]
        if nq == 0:
            continue
        group = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
    return torch.cat(outs)


def test_varlen_dispatch_with_cpu_kernel(monkeypatch):
    monkeypatch.setattr(va, "varlen_available", lambda q: True)
    monkeypatch.setattr(va, "_varlen_kernel", bottom_right_causal_kernel)
    q, k, v = make_qkv(LENGTHS)
    out = va.packed_causal_attention(q, k, v, cu_of(LENGTHS))
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("takes", "scale"),
    [
        (frozenset({"scale", "window_size"}), 0.2),  # torch 2.11: no enable_gqa
        (frozenset({"window_size"}), 0.2),  # no scale either: folded into q
        (frozenset({"scale", "window_size", "enable_gqa"}), 0.2),  # torch 2.13
    ],
)
def test_varlen_call_adapts_to_the_torch_signature(monkeypatch, takes, scale):
    """`_varlen_kernel` passes only the keywords this torch's varlen_attn takes; a stand-in
    that refuses what it does not know computes the same attention as the fp64 reference."""
    calls = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        assert set(kw) <= takes, f"passed {set(kw) - takes}"
        assert kw["window_size"] == (-1, 0)
        if k.shape[1] != q.shape[1]:
            assert kw.get("enable_gqa"), "GQA without enable_gqa"
        calls.append(kw)
        used = kw.get("scale", 1 / math.sqrt(q.shape[-1]))
        return bottom_right_causal_kernel(q, k, v, cu_q, cu_k, max_q, max_k, used)

    monkeypatch.setattr(va, "_varlen_attn", varlen_attn)
    monkeypatch.setattr(va, "_VARLEN_PARAMS", takes)
    q, k, v = make_qkv(LENGTHS)
    cu = cu_of(LENGTHS)
    out = va._varlen_kernel(q, k, v, cu, cu, 8, 8, scale)
    torch.testing.assert_close(
        out, reference(q, k, v, LENGTHS, scale=scale), rtol=1e-10, atol=1e-10
    )
    assert len(calls) == 1


@pytest.mark.parametrize("groups_right", [True, False])
def test_grouped_heads_passed_as_they_are_where_the_kernel_groups_them(monkeypatch, groups_right):
    """torch 2.11 (no ``enable_gqa``): key/value heads go to the kernel unrepeated once a probe
    has found that it groups them as Megatron does (h -> h // (Hq / Hkv)); a kernel grouping
    them otherwise (h -> h % Hkv) is found out and gets repeated heads. The result is the fp64
    reference's either way."""
    heads_seen = []

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
        heads_seen.append(k.shape[1])
        if not groups_right and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            order = torch.arange(q.shape[1]) % k.shape[1]  # interleaved: wrong for Megatron
            k, v = k[:, order], v[:, order]
            assert group > 1
        return bottom_right_causal_kernel(q, k, v, cu_q, cu_k, max_q, max_k, kw["scale"])

    monkeypatch.setattr(va, "_varlen_attn", varlen_attn)
    monkeypatch.setattr(va, "_VARLEN_PARAMS", frozenset({"scale", "window_size"}))
    q, k, v = make_qkv(LENGTHS)
    cu = cu_of(LENGTHS)
    out = va._varlen_kernel(q, k, v, cu, cu, 8, 8, 0.3)
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, scale=0.3), rtol=1e-10, atol=1e-10)
    # the probe's two calls (2 and 4 heads), then the real one
    assert heads_seen == [2, 4, HKV if groups_right else HQ]


def test_bad_shapes_raise():
    q, k, v = make_qkv([3])
    with pytest.raises(LossInputError, match="cu_seqlens"):
        va.packed_causal_attention(q, k, v, cu_of([4]))
    with pytest.raises(LossInputError, match="multiple of k heads"):
        va.packed_causal_attention(q[:, :3], k, v, cu_of([3]))


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and va._varlen_attn is not None),
    reason="needs CUDA and torch.nn.attention.varlen",
)
def test_varlen_flash_path_on_gpu():
    lengths = [1, 3, 8, 37]
    q, k, v = make_qkv(lengths, dtype=torch.bfloat16, device="cuda")
    assert va.varlen_available(q)
    grad_out = torch.randn(sum(lengths), HQ, D, dtype=torch.float64)
    out, grads = forward_backward(
        lambda a, b, c: va.packed_causal_attention(a, b, c, cu_of(lengths).cuda()),
        q,
        k,
        v,
        grad_out.to("cuda", torch.bfloat16),
    )
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref, ref_grads = forward_backward(
        lambda a, b, c: reference(a, b, c, lengths), qr, kr, vr, grad_out.bfloat16().double()
    )
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.cpu().double(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and va._varlen_attn is not None),
    reason="needs CUDA and torch.nn.attention.varlen",
)
def test_flash_kernel_is_bottom_right_causal_on_gpu():
    # the CP flash path relies on it: query segments shorter than their key segments (a local
    # chunk against its sequence's key prefix) see keys <= len_k - len_q + j
    g = torch.Generator().manual_seed(3)
    q_lens, k_lens = [2, 2, 1, 4, 3], [2, 8, 4, 16, 3]
    q = torch.randn(sum(q_lens), HQ, D, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(sum(k_lens), HKV, D, generator=g).to("cuda", torch.bfloat16)
    v = torch.randn(sum(k_lens), HKV, D, generator=g).to("cuda", torch.bfloat16)
    cu_q, cu_k = cu_of(q_lens).cuda(), cu_of(k_lens).cuda()
    out = va._varlen_kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.25)
    want = bottom_right_causal_kernel(
        *(t.cpu().double() for t in (q, k, v)), cu_q.cpu(), cu_k.cpu(), 0, 0, 0.25
    )
    torch.testing.assert_close(out.cpu().double(), want, rtol=2e-2, atol=2e-2)


def _cudnn_stand_in(q, k, v, scale):
    """cudnn_causal's contract on one sequence, in fp64 on the CPU (the reference's maths)."""
    return reference(q, k, v, [q.shape[0]], scale=scale)


@pytest.mark.parametrize("lengths", [[37], [1, 3, 0, 8]])
def test_long_packs_go_to_cudnn_one_call_per_sequence(monkeypatch, lengths):
    """A pack whose longest sequence is long runs `cudnn_causal` once per sequence (a whole-pack
    sequence without reading the bounds back), a sequence cuDNN refuses on flash alone; the
    result is the fp64 reference's."""
    from unirl.backends import cudnn_attention as ca

    calls, flash = [], []

    def cudnn_causal(q, k, v, scale):
        calls.append(q.shape[0])
        if q.shape[0] == 1:  # a sequence cuDNN refuses (torch 2.11's did, in such a pack)
            raise RuntimeError("No available kernel. Aborting execution.")
        return _cudnn_stand_in(q, k, v, scale)

    def flash_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        flash.append(q.shape[0])
        return bottom_right_causal_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale)

    monkeypatch.setattr(va, "varlen_available", lambda q: True)
    monkeypatch.setattr(va, "use_cudnn", lambda q, longest: longest >= 8)
    monkeypatch.setattr(va, "_varlen_kernel", flash_kernel)
    monkeypatch.setattr(ca, "cudnn_causal", cudnn_causal)
    q, k, v = make_qkv(lengths)
    out = va.packed_causal_attention(q, k, v, cu_of(lengths), longest_seq=max(lengths))
    torch.testing.assert_close(out, reference(q, k, v, lengths), rtol=1e-10, atol=1e-10)
    assert calls == [n for n in lengths if n]
    assert flash == [n for n in lengths if n == 1]  # the refused sequence, alone, on flash


def test_cudnn_is_not_chosen_off_the_gpu_or_for_short_packs(monkeypatch):
    from unirl.backends import cudnn_attention as ca

    monkeypatch.setenv("UNIRL_CUDNN_ATTENTION", "1")
    q = torch.zeros(4, HQ, D)
    assert not ca.use_cudnn(q, 1 << 20)  # the CPU
    monkeypatch.setattr(ca, "_WORKS", {(0, torch.bfloat16, D): True})
    fake = torch.zeros(4, HQ, D, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert ca.use_cudnn(fake, ca.MIN_LONGEST)
    assert not ca.use_cudnn(fake, ca.MIN_LONGEST - 1)
    monkeypatch.delenv("UNIRL_CUDNN_ATTENTION")  # on by default
    assert ca.use_cudnn(fake, ca.MIN_LONGEST)
    for off in ("0", "false", "Off", "no"):  # the way out
        monkeypatch.setenv("UNIRL_CUDNN_ATTENTION", off)
        assert not ca.use_cudnn(fake, ca.MIN_LONGEST), off
    other = torch.zeros(4, HQ, 2 * D, dtype=torch.bfloat16)  # another head dim: probed anew
    monkeypatch.setenv("UNIRL_CUDNN_ATTENTION", "1")
    monkeypatch.setattr(ca, "_probe", lambda device, dtype, head_dim: f"no kernel at {head_dim}")
    assert not ca.use_cudnn(other, ca.MIN_LONGEST)
    assert ca._WORKS[(0, torch.bfloat16, 2 * D)] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuDNN attention)")
@pytest.mark.parametrize("lengths", [[37], [1, 3, 8, 37]])
def test_cudnn_path_on_gpu(monkeypatch, lengths):
    """Packs sent to cuDNN (the threshold lowered to reach it) against the fp64 reference,
    forward and backward; the Hugging Face backends' attention function likewise."""
    from unirl.backends import cudnn_attention as ca
    from unirl.backends.hf import packed as hf_packed

    monkeypatch.setattr(ca, "MIN_LONGEST", 1)
    monkeypatch.setenv("UNIRL_CUDNN_ATTENTION", "1")
    q, k, v = make_qkv(lengths, dtype=torch.bfloat16, device="cuda")
    assert ca.use_cudnn(q, max(lengths)), "the probe refused cuDNN on this GPU"
    grad_out = torch.randn(sum(lengths), HQ, D, dtype=torch.float64)
    qr, kr, vr = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref, ref_grads = forward_backward(
        lambda a, b, c: reference(a, b, c, lengths), qr, kr, vr, grad_out.bfloat16().double()
    )
    cu = cu_of(lengths).cuda()
    paths = {
        "megatron": lambda a, b, c: va.packed_causal_attention(a, b, c, cu),
        "hf": lambda a, b, c: hf_packed.packed_attention(
            torch.nn.Module(), *(t.transpose(0, 1)[None] for t in (a, b, c)), None,
            cu_seq_lens_q=cu, max_length_q=max(lengths),
        )[0][0],
    }  # fmt: skip
    for name, fn in paths.items():
        for t in (q, k, v):
            t.grad = None
        out, grads = forward_backward(fn, q, k, v, grad_out.to("cuda", torch.bfloat16))
        torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2, msg=name)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.cpu().double(), want, rtol=3e-2, atol=3e-2, msg=name)


def test_cudnn_probe_inside_an_activation_checkpoint(monkeypatch):
    """The first long pack probes cuDNN inside a checkpointed forward; the recompute does not
    probe again, so the probe's tensors must not count as the checkpoint's (FSDP2 on an H100
    raised "A different number of tensors was saved")."""
    from torch.utils.checkpoint import checkpoint

    from unirl.backends import cudnn_attention as ca

    monkeypatch.setattr(ca, "cudnn_causal", _cudnn_stand_in)  # the probe runs on the CPU
    probed = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        if not probed:  # as use_cudnn's cache: once per device and dtype
            probed.append(ca._probe(torch.device("cpu"), torch.float32))
        return (x * x).sin()

    x = torch.randn(5, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert probed == [None]
    torch.testing.assert_close(x.grad, (2 * x * (x * x).cos()).detach())
