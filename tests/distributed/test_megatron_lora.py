"""LoRA on the Megatron backend (`unirl.backends.megatron.lora`) against transformers + peft in
fp32, over gloo.

The reference is written here: a tiny Llama with random weights saved as a Hugging Face folder
(``model.path``) and a peft adapter on every linear with random, non-zero A and B saved with
``save_pretrained`` (``model.lora.path``). Per layout (one rank; TP2 with and without sequence
parallel; PP2; PP2 x VPP2; CP2; one rank with megatron's full recompute), one backend:

- per-token log-probs of the policy equal peft's (each sequence run alone), and of the
  reference role the base model's (peft's ``disable_adapter``: the adapter off, no second model);
- one `forward_backward` of ``sum(w * mask * logprob)`` gives peft's autograd gradient of every
  adapter tensor (read from megatron's ``main_grad`` in PEFT names) and its norm;
- one optimizer step moves the adapter as torch's AdamW does from those gradients clipped to
  norm 1, and leaves
  every base weight bit for bit unchanged;
- the merged export (`hf_state_dict`) is ``W + scale * B @ A`` computed here, and the exported
  PEFT folder reloads with ``PeftModel.from_pretrained`` to the trainer's log-probs.
"""

import copy
import importlib.util
import itertools

import pytest
import torch

from tests.contract.lora import adapter_gradients
from tests.distributed.test_megatron_backend import _microbatch
from tests.spawn import run_distributed
from tests.tiny_models import TINY_LLAMA, noisy_hf_model

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="needs megatron-core (pip install unirl[megatron])",
)
transformers = pytest.importorskip("transformers", reason="needs transformers (unirl[hf])")
peft = pytest.importorskip("peft", reason="needs peft (unirl[lora])")

VOCAB = 100
RANK, ALPHA = 4, 8.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
LR, BETAS, EPS, CLIP = 1e-2, (0.9, 0.95), 1e-8, 1.0
MICROBATCHES = ([5, 2, 7], [3, 6])
ATOL = 1e-4


def _hf_config(layers):
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    fields |= {"num_hidden_layers": layers, "vocab_size": VOCAB, "tie_word_embeddings": False}
    return transformers.AutoConfig.for_model("llama", **fields)


def _lora_config():
    return peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)


def _folders(tmp_path, layers):
    """The base model's folder and a peft adapter folder (A and B random, B non-zero)."""
    base = noisy_hf_model(_hf_config(layers), seed=3)
    base.save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(copy.deepcopy(base), _lora_config())
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                # the head's adapter smaller: a large one makes gradients of ~30 whose fp32
                # rounding Adam's normalisation lifts past the tolerance on near-zero entries
                scale = 0.03 if ".lm_head." in name else 0.3
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)  # the adapter alone
    return str(tmp_path / "base"), str(tmp_path / "adapter")


def _weights(mb):
    """Per-token weights of the test's loss: varied, and a function of each token's sequence and
    position, so a context-parallel rank's share of a microbatch weighs its tokens the same."""
    return torch.sin(0.7 * mb.position_ids + 1.3 * mb.seq_ids)


def _cp_layout(mb, topology):
    return _layout(mb, topology.cp_size, topology.cp_rank)


def _layout(mb, cp_size, cp_rank):
    from unirl.core.data.context_parallel import CPLayout

    return CPLayout.build(mb.cu_seqlens.long(), cp_size, cp_rank)


def _split(mb, cp, tensor):
    """A whole-microbatch tensor cut to the tokens of context-parallel rank ``cp[1]``."""
    return tensor if cp[0] == 1 else _layout(mb, *cp).split(tensor)


def _local(mb, topology):
    """This context-parallel rank's share of a whole-sequence microbatch (core's split)."""
    if topology.cp_size == 1:
        return mb
    layout = _cp_layout(mb, topology)
    return mb.with_fields(
        tokens=layout.split(mb.tokens),
        targets=layout.split(mb.targets),
        loss_mask=layout.split(mb.loss_mask),
        position_ids=layout.position_ids,
        seq_ids=layout.seq_ids,
        cu_seqlens=layout.local_cu_seqlens.to(torch.int32),
        global_cu_seqlens=mb.cu_seqlens,
        cp_group=topology.groups.cp,
    )


def _config(base, adapter, parallel):
    parallel = dict(parallel)
    recompute = parallel.pop("recompute", False)
    return {
        "backend": "megatron",
        "model": {
            "path": base,
            "dtype": "fp32",
            "max_seq_len": 16,
            "gradient_checkpointing": recompute,
            "lora": {"rank": RANK, "alpha": ALPHA, "target_modules": TARGETS, "path": adapter},
        },
        "optimizer": {"lr": LR, "betas": list(BETAS), "eps": EPS, "grad_clip": CLIP},
        "batch": {
            "prompts_per_rollout": 2,
            "samples_per_prompt": 2,
            "samples_per_optimizer_step": 4,
            "micro_batch_size": 2,
        },
        "parallel": parallel,
        "train": {"seed": 0},
        "logging": {"tensorboard": False},
    }


def _loss_fn(mb, logprobs, entropy, /, **_):
    return (_weights(mb) * mb.loss_mask * logprobs).sum(), {}


def _base_params(backend):
    return {
        f"{i}.{n}": p.detach().clone()
        for i, chunk in enumerate(backend.model)
        for n, p in chunk.named_parameters()
        if not p.requires_grad
    }


# the adapter's accumulated gradient in PEFT names: the contract's probe
_grads = adapter_gradients


def _worker(rank, world_size, base, adapter, parallel, out_dir):
    from unirl.backends.megatron import build_backend
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec
    from unirl.core.progress.bars import MicrobatchProgress

    cfg = config_from_dict(_config(base, adapter, parallel), world_size=world_size)
    backend = build_backend(cfg, total_optimizer_steps=1, needs_reference=True)
    topo = backend.topology
    whole = [_microbatch(lengths, seed=i) for i, lengths in enumerate(MICROBATCHES)]
    mbs = [_local(mb, topo) for mb in whole]
    spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size)
    out = {"loaded": backend.adapter_state_dict(), "pp_rank": topo.pp_rank}
    out["cp"] = (topo.cp_size, topo.cp_rank)
    before = _base_params(backend)
    for role in ("policy", "reference"):
        with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
            out[role] = backend.forward_logprobs(mbs, role=role, spec=spec, progress=bar)
    with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
        backend.forward_backward(mbs, loss_fn=_loss_fn, spec=spec, progress=bar)
    out["grads"] = _grads(backend)
    out["grad_norm"] = backend.optimizer_step().grad_norm
    out["stepped"] = backend.adapter_state_dict()
    after = _base_params(backend)
    out["base_unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["merged"] = backend.hf_state_dict()
    with MicrobatchProgress("test", len(mbs), topo, enabled=False) as bar:
        out["stepped_logprobs"] = backend.forward_logprobs(
            mbs, role="policy", spec=spec, progress=bar
        )
    backend.export_adapter(out_dir)
    backend.close()
    return out


def _logprobs(model, mb):
    """Per packed position, log p(target) of each sequence run alone."""
    out = []
    for start, end in itertools.pairwise(mb.cu_seqlens.tolist()):
        logits = model(mb.tokens[start:end][None]).logits[0]
        out.append(torch.log_softmax(logits, -1).gather(1, mb.targets[start:end, None])[:, 0])
    return torch.cat(out)


def _peft_state(model):
    # the adapter alone (with lm_head a target, peft would also save the head's base weight)
    state = peft.get_peft_model_state_dict(model, save_embedding_layers=False)
    return {k: v.detach().clone() for k, v in state.items()}


def _peft_grads(model):
    return {
        n.replace(".default", ""): p.grad.clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _reference(base, adapter, mbs):
    """peft's log-probs (adapter on and off), gradients, and its AdamW step."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    model = peft.PeftModel.from_pretrained(hf, adapter, is_trainable=True).eval()
    ref = {"state": _peft_state(model)}
    with torch.no_grad(), model.disable_adapter():
        ref["reference"] = [_logprobs(model, mb) for mb in mbs]
    loss = 0.0
    ref["policy"] = []
    for mb in mbs:
        logp = _logprobs(model, mb)
        ref["policy"].append(logp.detach())
        loss = loss + (_weights(mb) * mb.loss_mask * logp).sum()
    loss.backward()
    ref["grads"] = _peft_grads(model)
    ref["grad_norm"] = torch.sqrt(sum((g.double() ** 2).sum() for g in ref["grads"].values()))
    params = [p for p in model.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, CLIP)  # megatron's clip: CLIP / (norm + 1e-6)
    torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0).step()
    ref["stepped"] = _peft_state(model)
    return ref


def _close(got, want, what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:4])
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=1e-4, msg=name)


LAYOUTS = {
    "single": (1, {}, 2),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}, 2),
    "pp2": (2, {"pp": 2}, 2),
    "pp2_vpp2": (2, {"pp": 2, "vpp": 2}, 4),
    "tp2": (2, {"tp": 2}, 2),
    "cp2": (2, {"cp": 2}, 2),
    # megatron's full recompute of every layer: the frozen embedding's output must still carry
    # autograd into the first recomputed layer (`install_lora`'s ``recompute``)
    "recompute": (1, {"recompute": True}, 2),
}
# The default tier: one rank with full recompute (everything one rank tests, and the embedding
# fix), TP2 with sequence parallel (the branch's harder comm), PP2; the slow one adds one rank
# without recompute, VPP's chunks, TP2 without sequence parallel and CP2 (nothing of LoRA's own)
SLOW = {"single", "pp2_vpp2", "tp2", "cp2"}


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=[pytest.mark.slow] if k in SLOW else []) for k in LAYOUTS]
)
def test_lora_matches_peft(tmp_path, layout):
    world, parallel, layers = LAYOUTS[layout]
    base, adapter = _folders(tmp_path, layers)
    results = run_distributed(_worker, world, base, adapter, parallel, str(tmp_path / "out"))
    mbs = [_microbatch(lengths, seed=i) for i, lengths in enumerate(MICROBATCHES)]
    ref = _reference(base, adapter, mbs)
    last = max(r["pp_rank"] for r in results)
    for r in results:
        _close(r["loaded"], ref["state"], "loaded adapter")
        _close(r["grads"], ref["grads"], "gradients")
        assert r["grad_norm"] == pytest.approx(float(ref["grad_norm"]), rel=1e-4)
        _close(r["stepped"], ref["stepped"], "adapter after one step")
        assert r["base_unchanged"]
        if r["pp_rank"] != last:
            continue  # log-probs live on the last stage
        for role in ("policy", "reference"):
            for mb, got, want in zip(mbs, r[role], ref[role]):
                valid = _split(mb, r["cp"], mb.loss_mask).bool()
                want = _split(mb, r["cp"], want)
                torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=0)
    last_stage = next(r for r in results if r["pp_rank"] == last)
    _check_merged_and_export(last_stage, base, str(tmp_path / "out"), mbs)


def _check_merged_and_export(result, base, exported, mbs):
    """The merged weights are W + scale * B @ A of the stepped adapter; the exported folder
    reloads in peft with the trainer's log-probs."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    weights, adapter = hf.state_dict(), result["stepped"]
    scale = ALPHA / RANK
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        a = adapter.get(f"base_model.model.{module}.lora_A.weight")
        want = (
            w if a is None else w + scale * adapter[f"base_model.model.{module}.lora_B.weight"] @ a
        )
        torch.testing.assert_close(result["merged"][name], want, atol=1e-5, rtol=1e-5, msg=name)
    model = peft.PeftModel.from_pretrained(hf, exported).eval()
    with torch.no_grad():
        for mb, got in zip(mbs, result["stepped_logprobs"]):
            valid = _split(mb, result["cp"], mb.loss_mask).bool()
            want = _split(mb, result["cp"], _logprobs(model, mb))
            torch.testing.assert_close(got[valid], want[valid], atol=ATOL, rtol=0)


# --- checkpoints ----------------------------------------------------------------------------


def _step(backend, mbs, spec):
    from unirl.core.progress.bars import MicrobatchProgress

    with MicrobatchProgress("test", len(mbs), backend.topology, enabled=False) as bar:
        backend.forward_backward(mbs, loss_fn=_loss_fn, spec=spec, progress=bar)
    backend.optimizer_step()


def _resume_worker(rank, world_size, base, adapter, ckpt):
    """Step, save, step (A); load, step again (B): A == B bit for bit; the loaded checkpoint
    holds the adapter and Adam's moments (the second step after loading equals the first)."""
    from unirl.backends.megatron import build_backend
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.maths.logprob_spec import LogprobSpec

    parallel = {"tp": 2, "sequence_parallel": True, "zero_stage": 1}
    cfg = config_from_dict(_config(base, adapter, parallel), world_size=world_size)
    backend = build_backend(cfg, total_optimizer_steps=3)
    mbs = [_microbatch(lengths, seed=i) for i, lengths in enumerate(MICROBATCHES)]
    spec = LogprobSpec(temperature=1.0, vocab_size=backend.vocab_size)
    _step(backend, mbs, spec)
    saved = backend.adapter_state_dict()
    backend.save_checkpoint(ckpt, {"note": 1})
    _step(backend, mbs, spec)
    first = backend.adapter_state_dict()
    _step(backend, mbs, spec)  # moves the adapter and the moments away from the checkpoint's
    client = backend.load_checkpoint(ckpt)
    loaded = backend.adapter_state_dict()
    _step(backend, mbs, spec)
    again = backend.adapter_state_dict()
    backend.close()
    return {"saved": saved, "loaded": loaded, "first": first, "again": again, "client": client}


def test_lora_checkpoint_resumes_exactly(tmp_path):
    base, adapter = _folders(tmp_path, 2)
    results = run_distributed(_resume_worker, 2, base, adapter, str(tmp_path / "ckpt"))
    for r in results:
        assert r["client"]["note"] == 1
        for name, want in r["saved"].items():
            assert torch.equal(r["loaded"][name], want), name
        for name, want in r["first"].items():
            assert torch.equal(r["again"][name], want), name
            assert not torch.equal(want, r["saved"][name]), name  # the step moved it


# --- refusals ---------------------------------------------------------------------------------


def _build_worker(rank, world_size, cases):
    """Each case's config built on TP2: the `ConfigError` message it raises, or the adapter
    it starts with."""
    from megatron.core import parallel_state as ps

    from unirl.backends.megatron import build_backend
    from unirl.core.config.run_config import config_from_dict
    from unirl.core.errors import ConfigError

    out = []
    for case in cases:
        cfg = config_from_dict(case, world_size=world_size)
        try:
            backend = build_backend(cfg, total_optimizer_steps=1)
        except ConfigError as exc:
            out.append(str(exc))
            ps.destroy_model_parallel()
            continue
        out.append(backend.adapter_state_dict())
        backend.close()
    return out


def test_adapter_init_and_refusals(tmp_path):
    """Without ``model.lora.path``: A drawn per module from ``init_seed`` and its PEFT name
    (``U(-1/sqrt(in), 1/sqrt(in))``, peft's bound), whole on every TP rank, B zero. Refused, naming
    the key: dropout under TP, a PEFT tensor no linear takes."""
    import zlib

    from safetensors.torch import load_file, save_file

    base, adapter = _folders(tmp_path, 2)
    weights = f"{adapter}/adapter_model.safetensors"
    tensors = load_file(weights)
    stray = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"  # no layer 7
    save_file(tensors | {stray: torch.zeros(RANK, 32)}, weights)
    fresh = _config(base, None, {"tp": 2})
    fresh["model"]["lora"] |= {"init_seed": 3}
    dropout = _config(base, None, {"tp": 2})
    dropout["model"]["lora"] |= {"dropout": 0.1}
    cases = [fresh, dropout, _config(base, adapter, {"tp": 2})]
    for started, *messages in run_distributed(_build_worker, 2, cases):
        assert set(started) == set(tensors)  # every module peft adapts, in its names
        for name, t in started.items():
            if ".lora_B." in name:
                assert torch.equal(t, torch.zeros_like(t)), name
                continue
            gen = torch.Generator().manual_seed(3 + zlib.crc32(name.encode()))
            bound = 1 / t.shape[1] ** 0.5
            assert torch.equal(t, (torch.rand(t.shape, generator=gen) * 2 - 1) * bound), name
        assert "model.lora.dropout=0.1 with tensor parallel 2" in messages[0]
        assert f"has 1 tensor(s) no adapted linear takes, first {stray!r}" in messages[1]
