"""The loss inside the Hugging Face fused head (``model.fused_head`` with ``spec.loss_in_head``) on
the DeepSpeed (ZeRO-0 and ZeRO-3) and FSDP2 backends, one process: an optimizer step over two
microbatches and an empty one equals the plain-PyTorch step on the full batch (gradient norm and
updated weights, the references of tests/hf_reference.py), the loss went through
core's `head_loss` (three head matmuls) for each microbatch with tokens, and the metrics are the
loss's own; without ``loss_in_head`` (a loss that is not separable, e.g. GSPO) the fused head
gives log-probs and the loss runs after it (four matmuls, no `head_loss`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.hf_reference import (  # noqa: E402
    bar,
    empty_microbatch,
    make_config,
    make_loss_fn,
    make_sequences,
    num_response_tokens,
    pack,
    reference_step,
)
from unirl.core import backend as core_backend  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def head_loss_calls(monkeypatch) -> list[int]:
    """The token counts of core's `head_loss` calls (the 3-matmul path) as backends reach it."""
    calls: list[int] = []
    original = core_backend.head_loss

    def counted(hidden, *args, **kwargs):
        calls.append(int(hidden.shape[0]))
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(core_backend, "head_loss", counted)
    return calls


def _backend(folder: Path, name: str):
    from unirl.backends import build_backend

    model = {"fused_head": True}
    if name.startswith("deepspeed"):
        cfg = make_config(folder, stage=int(name[-1]), model=model)
    else:
        from unirl.backends.fsdp2.plugin import Fsdp2Options

        cfg = make_config(folder, backend="fsdp2", backend_options=Fsdp2Options(), model=model)
    return build_backend(cfg, total_optimizer_steps=3)


@pytest.mark.parametrize("loss_in_head", [True, False], ids=["in-head", "after-head"])
@pytest.mark.parametrize("name", ["deepspeed-zero0", "deepspeed-zero3", "fsdp2"])
def test_step_matches_plain_pytorch(tiny_folder, head_loss_calls, name, loss_in_head):
    seqs = make_sequences(2)
    backend = _backend(tiny_folder, name)
    try:
        n = num_response_tokens(seqs)
        mbs = [pack(seqs[:3]), empty_microbatch(), pack(seqs[3:])]
        spec = LogprobSpec(with_entropy=True, entropy_grad=True, loss_in_head=loss_in_head)
        with bar(backend, len(mbs)) as progress:
            metrics = backend.forward_backward(
                mbs, loss_fn=make_loss_fn(n), spec=spec, progress=progress
            )
        stats = backend.optimizer_step()
        # the loss inside the head for each microbatch with tokens; none without loss_in_head
        expected_calls = [mbs[0].num_tokens, mbs[2].num_tokens] if loss_in_head else []
        assert head_loss_calls == expected_calls
        norm, expected = reference_step(tiny_folder, seqs, lr=1e-2, clip=0.5, weight_decay=0.1)
        assert stats.grad_norm == pytest.approx(norm, rel=1e-5)
        got = backend.hf_state_dict()  # gathered under ZeRO-3 and FSDP2
        # AdamW's first step moves each weight by about lr * g / (|g| + eps): for the few
        # elements whose gradient is within a few eps of 0 that magnifies fp32 rounding (the
        # head's hidden gradient is summed in another order), so 1e-5 here, a thousandth of lr
        for key, value in expected.items():
            torch.testing.assert_close(got[key].cpu(), value, atol=1e-5, rtol=1e-5, msg=key)
        # the metrics are the loss's own: the masked NLL sum of each microbatch
        ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder)
        with torch.no_grad():
            for mb, m in ((mbs[0], metrics[0]), (mbs[2], metrics[2])):
                nll = 0.0
                for s in range(len(mb.cu_seqlens) - 1):
                    lo, hi = int(mb.cu_seqlens[s]), int(mb.cu_seqlens[s + 1])
                    out = ref(input_ids=mb.tokens[lo:hi][None]).logits[0].double()
                    logp = torch.log_softmax(out, -1).gather(1, mb.targets[lo:hi, None])[:, 0]
                    nll -= float((logp * mb.loss_mask[lo:hi].double()).sum())
                assert float(m["nll"].numerator) == pytest.approx(nll, rel=1e-5)
        assert float(metrics[1]["nll"].denominator) == 0.0
    finally:
        backend.close()
