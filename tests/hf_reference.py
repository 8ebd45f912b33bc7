"""The Hugging Face backends' one-process references, shared by their unit tests
(tests/unit/test_deepspeed_backend.py, test_fsdp2_backend.py, test_hf_loss_in_head.py,
test_hf_moe_backends.py) and their two-process twins (tests/distributed/test_deepspeed_dp.py,
test_fsdp2_dp.py): the tiny Llama saved with plain transformers, packed microbatches built by
plain loops, and the plain-PyTorch step on the full batch the backends' steps must equal. Needs
transformers; DeepSpeed only where `full_params` gathers ZeRO-3 weights."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers

from tests.tiny_models import TINY_LLAMA
from unirl.core.config.run_config import (
    BatchConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProgressConfig,
    UnirlConfig,
)
from unirl.core.data.microbatch import TrainMicrobatch
from unirl.core.maths.logprob_spec import LogprobSpec
from unirl.core.maths.losses import Metric
from unirl.core.progress.bars import MicrobatchProgress

VOCAB = 64
HF_CONFIG = {**TINY_LLAMA, "vocab_size": VOCAB}
# (prompt length, response length); the 3rd has a one-token response.
SHAPES = [(2, 4), (3, 5), (2, 1), (4, 6), (1, 3), (2, 2)]
ENTROPY_COEF = 0.01


def save_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random llama saved with plain transformers (the reference weights of the tests)."""
    config = transformers.AutoConfig.for_model(**HF_CONFIG)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def make_sequences(seed: int, shapes=SHAPES) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per sequence."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (p + r,), generator=g).tolist(), p) for p, r in shapes]


def pack(seqs: list[tuple[list[int], int]]) -> TrainMicrobatch:
    """A packed microbatch built by plain loops: target t = token t+1 of the same sequence, mask 1
    where that target is a response token, 0 at each sequence's last position."""
    tokens, positions, targets, mask, seq_ids, cu, counts = [], [], [], [], [], [0], []
    for i, (ids, prompt) in enumerate(seqs):
        for t in range(len(ids)):
            tokens.append(ids[t])
            positions.append(t)
            seq_ids.append(i)
            last = t == len(ids) - 1
            targets.append(0 if last else ids[t + 1])
            mask.append(0.0 if last or t + 1 < prompt else 1.0)
        cu.append(cu[-1] + len(ids))
        counts.append(len(ids) - prompt)
    return TrainMicrobatch(
        sample_indices=tuple(range(len(seqs))),
        tokens=torch.tensor(tokens, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        targets=torch.tensor(targets, dtype=torch.long),
        loss_mask=torch.tensor(mask),
        seq_ids=torch.tensor(seq_ids, dtype=torch.long),
        seq_token_counts=torch.tensor(counts, dtype=torch.long),
    )


def empty_microbatch() -> TrainMicrobatch:
    none = torch.zeros(0, dtype=torch.long)
    return TrainMicrobatch(
        sample_indices=(),
        tokens=none,
        position_ids=none,
        cu_seqlens=torch.zeros(1, dtype=torch.int32),
        targets=none,
        loss_mask=torch.zeros(0),
        seq_ids=none,
        seq_token_counts=none,
    )


def make_loss_fn(global_tokens: int):
    """Token-mean NLL minus an entropy bonus, normalised by the step's global token count."""

    def loss_fn(mb, logprobs, entropy):
        nll = -(logprobs * mb.loss_mask).sum()
        ent = (entropy * mb.loss_mask).sum()
        loss = (nll - ENTROPY_COEF * ent) / global_tokens
        return loss, {
            "nll": Metric(numerator=nll.detach(), denominator=mb.loss_mask.sum(), kind="tokens")
        }

    return loss_fn


def num_response_tokens(seqs) -> int:
    return sum(len(ids) - prompt for ids, prompt in seqs)


def make_config(path: Path, **over) -> UnirlConfig:
    # warmup: the first step runs at lr = 2e-2 * 1/2 = 1e-2, set by the schedule, not by AdamW's
    # constructor lr; the references use 1e-2
    opt = dict(lr=2e-2, warmup_steps=2, grad_clip=0.5, weight_decay=0.1)
    opt.update(over.pop("optimizer", {}))
    model = dict(path=str(path))
    model.update(over.pop("model", {}))
    return UnirlConfig(
        model=ModelConfig(**model),
        optimizer=OptimizerConfig(**opt),
        batch=BatchConfig(
            prompts_per_rollout=2,
            samples_per_prompt=2,
            samples_per_optimizer_step=4,
            micro_batch_size=2,
        ),
        parallel=ParallelConfig(zero_stage=over.pop("stage", 0)),
        progress=ProgressConfig(enabled=False),
        **over,
    )


def reference_logprobs(model, seqs) -> list[torch.Tensor]:
    """Per sequence, log p(token t+1 | tokens <= t) for t < len-1, from a plain forward."""
    out = []
    for ids, _ in seqs:
        x = torch.tensor(ids)[None]
        logp = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        out.append(logp[:-1].gather(-1, x[0, 1:, None])[:, 0])
    return out


def reference_loss(model, seqs) -> torch.Tensor:
    """The step's loss written out per sequence: minus the response tokens' log-probs, minus the
    entropy bonus, over the batch's response tokens (the full model or a peft-wrapped one)."""
    n = num_response_tokens(seqs)
    total = torch.zeros(())
    for ids, prompt in seqs:
        x = torch.tensor(ids)[None]
        logp_all = torch.log_softmax(model(input_ids=x).logits[0].float(), dim=-1)
        logp = logp_all[:-1].gather(-1, x[0, 1:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)[:-1]
        valid = torch.tensor([1.0 if t + 1 >= prompt else 0.0 for t in range(len(ids) - 1)])
        total = total + (-(logp * valid).sum() - ENTROPY_COEF * (entropy * valid).sum()) / n
    return total


def reference_step(folder: Path, seqs, *, lr: float, clip: float, weight_decay: float):
    """The plain-PyTorch step on the full batch: returns (grad norm before clipping, new params)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    reference_loss(model, seqs).backward()
    params = list(model.parameters())
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    torch.nn.utils.clip_grad_norm_(params, clip)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    opt.step()
    return norm, {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_logprobs_match(flat: torch.Tensor, expected: list[torch.Tensor], seqs, atol: float):
    """`flat` is the packed ``[T]`` output; the last position of each sequence predicts nothing,
    so the len-1 others are compared with the per-sequence references."""
    start = 0
    for (ids, _), exp in zip(seqs, expected):
        torch.testing.assert_close(flat[start : start + len(ids) - 1], exp, atol=atol, rtol=0)
        start += len(ids)
    assert start == flat.numel()


def full_params(backend) -> dict[str, torch.Tensor]:
    """The policy's parameters, gathered under ZeRO-3."""
    import deepspeed

    module = backend.model
    params = list(module.parameters())
    if backend.engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone() for k, v in module.named_parameters()}
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def bar(backend, n: int) -> MicrobatchProgress:
    return MicrobatchProgress("test", n, backend.topology, enabled=False)


def train_step(backend, mbs, global_tokens: int, *, loss_in_head: bool = False):
    spec = LogprobSpec(with_entropy=True, entropy_grad=True, loss_in_head=loss_in_head)
    with bar(backend, len(mbs)) as progress:
        metrics = backend.forward_backward(
            mbs,
            loss_fn=make_loss_fn(global_tokens),
            spec=spec,
            progress=progress,
        )
        assert progress.count == len(mbs)
    return metrics, backend.optimizer_step()
