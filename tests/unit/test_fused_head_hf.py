"""The Hugging Face fused head (`unirl.backends.hf.fused_head`, the DeepSpeed and FSDP2 backends'
``model.fused_head``): inside a request the model returns per-token log-probs and entropy that
equal fp64 ``log_softmax`` of its own logits, with the gradients autograd gives through those
logits; outside one it is the plain head; heads it cannot fuse are refused by name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.tiny_models import MICRO_LLAMA  # noqa: E402
from unirl.backends.hf.fused_head import (  # noqa: E402
    FusedLMHead,
    install_fused_head,
    split_head_output,
)
from unirl.core.errors import ConfigError  # noqa: E402
from unirl.core.maths.logprob_spec import LogprobSpec  # noqa: E402

HF_CONFIG = dict(MICRO_LLAMA)
TEMPERATURE = 0.8


def _model(**overrides):
    torch.manual_seed(5)
    config = transformers.AutoConfig.for_model(**{**HF_CONFIG, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


@pytest.mark.parametrize("tied", [False, True])
def test_request_gives_logprobs_and_entropy_of_the_logits(tied) -> None:
    model = _model(tie_word_embeddings=tied)
    keys = set(model.state_dict())
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 40, (9,), generator=torch.Generator().manual_seed(2))
    w_logp, w_ent = torch.randn(9), torch.randn(9)

    # reference: fp64 log_softmax of the plain model's logits, autograd through them
    logits = model(ids).logits[0].double() / TEMPERATURE
    logp_all = torch.log_softmax(logits, -1)
    ref_logp = logp_all.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(logp_all.exp() * logp_all).sum(-1)
    ((w_logp.double() * ref_logp).sum() + (w_ent.double() * ref_ent).sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    head = install_fused_head(model)
    assert isinstance(model.lm_head, FusedLMHead) and set(model.state_dict()) == keys
    spec = LogprobSpec(temperature=TEMPERATURE, with_entropy=True, entropy_grad=True)
    with head.request(targets, spec):
        out = model(ids).logits[0]
    assert out.shape == (9, 2)
    logp, entropy = split_head_output(out, spec)
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_ent.detach(), atol=1e-5, rtol=1e-5)
    ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4)

    # outside a request: the plain head again
    torch.testing.assert_close(model(ids).logits[0].double() / TEMPERATURE, logits.detach())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(model_type="gemma2", final_logit_softcapping=30.0), "final_logit_softcapping"),
        (dict(model_type="granite", logits_scaling=8.0), "logits_scaling"),
    ],
)
def test_heads_that_transform_logits_are_refused(overrides, message) -> None:
    model = _model(**overrides, head_dim=8)
    with pytest.raises(ConfigError, match=message):
        install_fused_head(model)


def test_head_with_bias_is_refused() -> None:
    model = _model()
    model.lm_head = torch.nn.Linear(16, 40, bias=True)
    with pytest.raises(ConfigError, match="bias"):
        install_fused_head(model)
