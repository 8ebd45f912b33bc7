"""The verified sync's fingerprint (unirl/core/weights/fingerprint.py) against a plain per-layer
float64 computation written here, on Hugging Face tensors and on a receiver's layout built by
hand (q, k, v concatenated, gate and up concatenated, both split over two tensor-parallel ranks,
a replicated norm counted on one rank, a padded vocabulary cut to its real rows); and `compare`'s
errors: a changed layer, a name only one side knows, a tied head."""

from __future__ import annotations

import pytest
import torch

from unirl.core.weights.fingerprint import (
    Fingerprint,
    SyncVerificationError,
    compare,
    fingerprinted,
    layer_key,
    module_fingerprint,
)

VOCAB, PADDED, H, KV, FF = 10, 16, 8, 4, 12


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(VOCAB, H, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in [
            ("self_attn.q_proj.weight", (H, H)),
            ("self_attn.k_proj.weight", (KV, H)),
            ("self_attn.v_proj.weight", (KV, H)),
            ("self_attn.o_proj.weight", (H, H)),
            ("mlp.gate_proj.weight", (FF, H)),
            ("mlp.up_proj.weight", (FF, H)),
            ("mlp.down_proj.weight", (H, FF)),
            ("input_layernorm.weight", (H,)),
        ]:
            sd[p + name] = torch.randn(*shape, generator=g)
    sd["model.norm.weight"] = torch.randn(H, generator=g)
    sd["lm_head.weight"] = torch.randn(VOCAB, H, generator=g)
    return sd


def _reference(sd: dict[str, torch.Tensor]) -> dict[str, tuple[float, float, float, float]]:
    """Per layer, in float64: count, sum x, sum x^2, max |x| (written out, no unirl code)."""
    groups: dict[str, list[torch.Tensor]] = {}
    for name, t in sd.items():
        if ".layers." in name:
            key = "layer " + name.split(".layers.")[1].split(".")[0]
        else:
            key = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm"}.get(
                name, "lm_head"
            )
        groups.setdefault(key, []).append(t.double().reshape(-1))
    out = {}
    for key, parts in groups.items():
        x = torch.cat(parts)
        out[key] = (float(x.numel()), float(x.sum()), float((x * x).sum()), float(x.abs().max()))
    return out


def test_layer_keys():
    assert layer_key("model.layers.3.self_attn.qkv_proj.weight") == "layer 3"
    assert layer_key("model.layers.12.mlp.experts.7.down_proj.weight") == "layer 12"
    assert layer_key("model.embed_tokens.weight") == "embed_tokens"
    assert layer_key("model.norm.weight") == "norm"
    assert layer_key("lm_head.weight") == "lm_head"


def test_stream_fingerprint_is_the_plain_per_layer_float64_sums():
    sd = _model()
    seen = Fingerprint()
    buckets = [list(sd.items())[:7], list(sd.items())[7:]]
    assert [b for b in fingerprinted(iter(buckets), seen)] == buckets  # handed on as they are
    ref = _reference(sd)
    assert set(seen.keys) == set(ref)
    for key, stats in ref.items():
        assert seen.keys[key] == pytest.approx(stats, rel=1e-12, abs=1e-12), key


def test_the_receiver_dtype_is_applied_before_counting():
    t = torch.tensor([1.0 + 2**-12, -3.0])  # 1 + 2^-12 rounds to 1.0 in bf16
    seen = Fingerprint(dtype=torch.bfloat16)
    seen.add("model.norm.weight", t)
    assert seen.keys["norm"] == (2.0, -2.0, 10.0, 3.0)


def _fused_tp_shards(sd: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """A receiver's layout built by hand: per rank, q/k/v rows of its heads concatenated, gate
    and up rows concatenated, o/down split by columns, the vocabulary padded to PADDED rows and
    split by rows, norms replicated (every rank holds them; only rank 0 reports them)."""
    shards = []
    for r in range(tp):
        s: dict[str, torch.Tensor] = {}

        def rows(t: torch.Tensor, r: int = r) -> torch.Tensor:
            return t.chunk(tp, 0)[r]

        def cols(t: torch.Tensor, r: int = r) -> torch.Tensor:
            return t.chunk(tp, 1)[r]

        for i in range(2):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            s[a + "qkv_proj.weight"] = torch.cat(
                [rows(sd[a + "q_proj.weight"]), rows(sd[a + "k_proj.weight"]),
                 rows(sd[a + "v_proj.weight"])]
            )  # fmt: skip
            s[a + "o_proj.weight"] = cols(sd[a + "o_proj.weight"])
            m = p + "mlp."
            s[m + "gate_up_proj.weight"] = torch.cat(
                [rows(sd[m + "gate_proj.weight"]), rows(sd[m + "up_proj.weight"])]
            )
            s[m + "down_proj.weight"] = cols(sd[m + "down_proj.weight"])
            if r == 0:
                s[p + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = torch.cat([sd[name], torch.full((PADDED - VOCAB, H), 7.0)])
            shard = rows(padded)
            real = max(0, min(VOCAB - r * (PADDED // tp), PADDED // tp))
            s[name] = shard[:real]  # the receiver counts its real rows only
        if r == 0:
            s["model.norm.weight"] = sd["model.norm.weight"]
        shards.append(s)
    return shards


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_and_sharded_layout_gives_the_same_fingerprint(tp):
    sd = _model()
    parts = []
    for shard in _fused_tp_shards(sd, tp):
        fp = Fingerprint()
        for name, t in shard.items():
            fp.add(name, t)
        parts.append(fp.keys)
    held = Fingerprint.of(parts)
    ref = _reference(sd)
    for key, stats in ref.items():
        assert held.keys[key] == pytest.approx(stats, rel=1e-12, abs=1e-12), key
    sent = Fingerprint()
    for name, t in sd.items():
        sent.add(name, t)
    compare(sent, held, receiver="engine", version=1)  # no error


def _fp(sd: dict[str, torch.Tensor]) -> Fingerprint:
    fp = Fingerprint()
    for name, t in sd.items():
        fp.add(name, t)
    return fp


def test_compare_names_the_layer_that_differs_and_the_version():
    sd = _model()
    held = dict(sd)
    held["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].clone()
    held["model.layers.1.mlp.up_proj.weight"][3, 2] += 1e-3
    with pytest.raises(SyncVerificationError, match=r"policy version 4 to engine 0.*layer 1") as e:
        compare(_fp(sd), _fp(held), receiver="engine 0", version=4)
    assert e.value.layer == "layer 1"
    assert "after RL step 4" in str(e.value.at_step(4))


def test_compare_names_a_key_only_one_side_has():
    sd = _model()
    renamed = {k.replace("model.norm", "model.final_norm"): v for k, v in sd.items()}
    with pytest.raises(SyncVerificationError, match=r"left \['norm'\] unwritten"):
        compare(_fp(renamed), _fp(sd), receiver="engine", version=0)
    with pytest.raises(SyncVerificationError, match=r"trainer sent \['final_norm'\]"):
        compare(_fp(sd | {"model.final_norm.weight": sd["model.norm.weight"]}), _fp(sd),
                receiver="engine", version=0)  # fmt: skip


def test_a_tied_head_sent_with_the_embedding_values_is_not_a_missing_name():
    sd = _model()
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    held = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    compare(_fp(sd), _fp(held), receiver="engine", version=0)
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0  # untied values: the receiver lacks it
    with pytest.raises(SyncVerificationError, match="lm_head"):
        compare(_fp(sd), _fp(held), receiver="engine", version=0)


def test_module_fingerprint_counts_a_tied_parameter_once():
    emb = torch.nn.Embedding(VOCAB, H)
    model = torch.nn.Module()
    model.embed_tokens, model.lm_head = emb, torch.nn.Linear(H, VOCAB, bias=False)
    model.lm_head.weight = emb.weight
    fp = module_fingerprint(model)
    assert set(fp.keys) == {"embed_tokens"}
    assert fp.keys["embed_tokens"][0] == VOCAB * H


def test_what_the_fingerprint_cannot_catch_a_permutation_inside_a_layer():
    sd = _model()
    held = dict(sd)
    held["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].flip(0)
    compare(_fp(sd), _fp(held), receiver="engine", version=0)  # documented blind spot


def test_the_device_path_is_the_plain_float64_sums(monkeypatch):
    """On a GPU the sums stay on the device and reach the host once per tensor
    (`_device_stats`); run here on the CPU with chunks of 7 elements, against the plain sums."""
    from unirl.core.weights import fingerprint as fp

    monkeypatch.setattr(fp, "_DEVICE_CHUNK", 7)
    t = torch.randn(5, 9, generator=torch.Generator().manual_seed(3))
    x = t.double().reshape(-1)
    want = (45.0, float(x.sum()), float((x * x).sum()), float(x.abs().max()))
    assert fp._device_stats(t, None) == pytest.approx(want, rel=1e-12, abs=1e-12)
    bf = t.bfloat16().double().reshape(-1)  # the receiver's dtype applied first
    want = (45.0, float(bf.sum()), float((bf * bf).sum()), float(bf.abs().max()))
    assert fp._device_stats(t, torch.bfloat16) == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensor_stats_on_a_gpu_is_the_plain_float64_sums():
    from unirl.core.weights.fingerprint import tensor_stats

    t = torch.randn(3000, 1000, generator=torch.Generator().manual_seed(4)).bfloat16()
    x = t.double().reshape(-1)
    want = (float(x.numel()), float(x.sum()), float((x * x).sum()), float(x.abs().max()))
    # sums in another order: within float64 rounding of the sum of |x|
    assert tensor_stats(t.cuda()) == pytest.approx(
        want, rel=1e-12, abs=1e-13 * float(x.abs().sum())
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("numel", "have", "want"),
    [
        (0, torch.bfloat16, None),
        (1, torch.float32, None),
        (4095, torch.bfloat16, None),  # one partial block
        (4096 * 1000 + 17, torch.bfloat16, None),  # more blocks than programs: each loops
        (300_001, torch.float32, torch.bfloat16),  # the trainer's fp32, cast to the engine's
        (300_001, torch.float32, torch.float16),
        (300_001, torch.float16, torch.float32),  # a widening cast: the values as they are
        (5_000_000, torch.float32, None),
    ],
)
def test_the_gpu_kernel_is_the_plain_float64_sums(numel, have, want):
    """`fingerprint_triton`'s one pass against float64 sums written here, several tensors into
    one key (the atomics add up)."""
    from unirl.core.weights.fingerprint import Fingerprint

    g = torch.Generator().manual_seed(numel)
    parts = [torch.randn(numel, generator=g).to(have) * 3 for _ in range(2)]
    fp = Fingerprint(dtype=want)
    for t in parts:
        fp.add_tensor("k", t.cuda())
    x = torch.cat([(t.to(want) if want in (torch.bfloat16, torch.float16) else t) for t in parts])
    x = x.double()
    peak = float(x.abs().max()) if x.numel() else 0.0
    want_stats = (float(x.numel()), float(x.sum()), float((x * x).sum()), peak)
    # sums in another order: within float64 rounding of the sum of |x|
    assert fp.keys["k"] == pytest.approx(want_stats, rel=1e-12, abs=1e-13 * float(x.abs().sum()))


def _plain_stats(tensors, cast=None):
    x = torch.cat([(t.to(cast) if cast else t).double().reshape(-1) for t in tensors])
    peak = float(x.abs().max()) if x.numel() else 0.0
    return (float(x.numel()), float(x.sum()), float((x * x).sum()), peak), float(x.abs().sum())


def _bucket(device, keys=70):
    """A flat bucket's views at unaligned offsets, separate tensors, ``keys`` more keys (70:
    past the device buffer's first capacity): what `add_named` takes in one launch per dtype."""
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(20_000, generator=g).to(device)
    items = [("a", flat[:9001]), ("b", flat[9003:19_999]), ("a", flat[19_999:])]
    items += [(f"k{i}", torch.randn(37 * i + 1, generator=g).to(device)) for i in range(keys)]
    return items


def _check_bucket(fp, items, cast):
    for key in {k for k, _ in items}:
        want, scale = _plain_stats([t.cpu() for k, t in items if k == key], cast)
        assert fp.keys[key] == pytest.approx(want, rel=1e-12, abs=1e-13 * scale), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cast", [None, torch.bfloat16])
def test_one_launch_for_a_bucket_is_the_plain_float64_sums(cast):
    from unirl.core.weights.fingerprint import Fingerprint

    items = _bucket("cuda")
    fp = Fingerprint(dtype=cast)
    fp.add_many(items)
    _check_bucket(fp, items, cast)


_INTERPRETED = """
import sys, torch
import unirl.core.weights.fingerprint_triton as ft
from unirl.core.weights.fingerprint import Fingerprint
sys.path.insert(0, {tests!r})
from unit.test_weight_fingerprint import _bucket, _check_bucket
ft._programs = lambda index: 3  # a few programs and small blocks: each walks several blocks
ft._BLOCK = 256
ft._MAX_TENSORS = 4  # several launches per bucket, as past CUDA's 65,535 tensors per launch
for cast in (None, torch.float16):  # the interpreter's bf16 cast truncates (a GPU's rounds)
    items = _bucket("cpu", keys=5)
    sums = ft.DeviceSums(torch.device("cpu"), capacity=2)  # grows twice
    sums.add(items, cast)
    fp = Fingerprint(dtype=cast)
    for key, stats in sums.read().items():
        fp.add_stats(key, stats)
    _check_bucket(fp, items, cast)
print("ok")
"""


def test_the_gpu_kernel_in_triton_s_interpreter_is_the_plain_float64_sums():
    """The kernel's walk (offsets into one base, whole blocks then the tail, a slot per key,
    the slot buffer growing) run by Triton's CPU interpreter, so CI checks it without a GPU."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _INTERPRETED.format(tests=tests)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
