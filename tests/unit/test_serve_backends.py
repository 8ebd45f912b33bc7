"""One LoRA step with the SDK's Adam settings (gradient clipping active, weight decay) through
`unirl serve` on each backend, against peft + torch's AdamW with the same clip: the backends
differ in where the clip and the settings live (FSDP2's own optimizer, DeepSpeed's engine and
ZeRO wrappers, megatron's optimizer config and parameter groups). The adapter includes the LM
head (the SDK's default ``train_unembed=True``): on Megatron a vocabulary-parallel adapter whose
padding rows the export cuts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

tinker = pytest.importorskip("tinker")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from tinker import types  # noqa: E402

from tests.serve_fixtures import API_KEY, BASE, running_server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS, TARGETS = [1, 5, 9, 13, 2, 7], [5, 9, 13, 2, 7, 11]
CLIP, LR, WD = 0.05, 1e-2, 0.1


@pytest.mark.parametrize(
    "train",
    [
        {"backend": "fsdp2"},
        {"backend": "deepspeed", "parallel": {"zero_stage": 0}},
        {"backend": "deepspeed", "parallel": {"zero_stage": 2}},
        {"backend": "megatron", "model": {"dtype": "fp32"}},
    ],
    ids=["fsdp2", "deepspeed-zero0", "deepspeed-zero2", "megatron"],
)
def test_a_clipped_adam_step_matches_peft(tiny_folder, tmp_path, train):
    train = {**train, "progress": {"enabled": False}}
    with running_server(tiny_folder, tmp_path, train=train) as (url, _):
        got = sdk_step(url, tmp_path, unembed=True)
    assert_matches_peft(tiny_folder, got)


def sdk_step(url: str, state_dir: Path, *, unembed: bool) -> dict[str, Any]:
    """Through the SDK: a client, its initial adapter saved, one cross-entropy forward_backward,
    one clipped Adam step, the adapter saved: the loss, the norm and the two adapter folders."""
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    tc = service.create_lora_training_client(
        base_model=BASE, rank=2, seed=9, train_unembed=unembed
    ).result()
    tc.save_state("init").result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS),
            loss_fn_inputs={"target_tokens": TARGETS, "weights": [1.0] * 6},
        )
    ]
    out = tc.forward_backward(data, "cross_entropy").result()
    adam = types.AdamParams(learning_rate=LR, eps=1e-2, weight_decay=WD, grad_clip_norm=CLIP)
    norm = tc.optim_step(adam).result().metrics["grad_norm:mean"]
    tc.save_state("step").result()
    folder = state_dir / tc.model_id.replace(":", "_") / "weights"
    service.close("success")
    return {
        "loss": out.metrics["loss:sum"],
        "logprobs": out.loss_fn_outputs[0]["logprobs"].tolist(),
        "norm": norm,
        "init": folder / "init" / "adapter",
        "step": load_file(folder / "step" / "adapter" / "adapter_model.safetensors"),
    }


def assert_matches_peft(tiny_folder: Path, got: dict[str, Any]) -> None:
    """The reference: peft on the saved initial adapter, the loss written out, torch's clip and
    AdamW."""
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    ref = peft.PeftModel.from_pretrained(base, got["init"], is_trainable=True)
    logits = ref(input_ids=torch.tensor([TOKENS])).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(TARGETS)[:, None])[:, 0]
    loss = -logprobs.sum()
    assert got["loss"] == pytest.approx(float(loss), rel=1e-5)
    torch.testing.assert_close(torch.tensor(got["logprobs"]), logprobs.detach(), atol=1e-5, rtol=0)
    loss.backward()
    params = [p for p in ref.parameters() if p.requires_grad]
    want_norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
    assert float(want_norm) > CLIP  # the clip is active
    assert got["norm"] == pytest.approx(float(want_norm), rel=1e-5)
    torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-2, weight_decay=WD).step()
    want = peft.get_peft_model_state_dict(ref, save_embedding_layers=False)
    for name, value in want.items():
        torch.testing.assert_close(
            got["step"][name], value.detach(), atol=1e-6, rtol=1e-5, msg=name
        )
