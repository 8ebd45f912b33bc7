"""What tinker-cookbook's loop scripts fetch from the network, written locally for the tests: a
tokenizer (every byte one token, plus Qwen3's chat tokens, so the cookbook's ``qwen3`` renderer
runs on it), a tiny Llama whose vocabulary matches it, and a few dataset rows in the shape of
the datasets the scripts load (``HuggingFaceH4/no_robots``'s ``messages``, ``openai/gsm8k``'s
``question`` / ``answer``). Nothing here is a reference."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# The name the scripts ask for: a model the cookbook knows (its renderer: qwen3); the server
# maps it to the local tiny model, the cookbook's tokenizer registry to the local tokenizer.
MODEL_NAME = "Qwen/Qwen3-8B"
CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

NO_ROBOTS = [
    [
        {"role": "user", "content": f"Write a line about the number {i}."},
        {"role": "assistant", "content": f"{i} is a fine number, said the line."},
    ]
    for i in range(8)
]
# Every answer is 2: the RL test's base model is taught to answer \boxed{2} about half the time
# (`teach_answer`), so a group's rewards differ and the loop trains.
GSM8K = [
    {"question": f"What is {i} plus {2 - i}?", "answer": f"{i} + {2 - i} = 2\n#### 2"}
    for i in range(3)
]
# rl_loop.py's prompt: its one-shot example, then the question with this suffix.
_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
_EXAMPLE = [
    {"role": "user", "content": "How many r's are in strawberry?" + _SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
        "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def write_model_and_tokenizer(folder: Path) -> Path:
    """The tokenizer and a tiny random Llama of its vocabulary, in one Hugging Face folder."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.tiny_models import TINY_LLAMA

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
    tokenizer.save_pretrained(folder)
    shape = {**TINY_LLAMA, "vocab_size": len(tokenizer), "max_position_embeddings": 1024}
    config = transformers.AutoConfig.for_model(**shape)
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def teach_answer(folder: Path, steps: int) -> None:
    """A few Adam steps of the model in ``folder`` towards answering ``\\boxed{2}`` to the
    GSM8K rows as rl_loop.py prompts them (about 25 steps: about half of its samples do)."""
    import torch
    import transformers
    from tinker_cookbook import renderers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    renderer = renderers.get_renderer("qwen3", tokenizer)
    answer = [*tokenizer.encode("\\boxed{2}", add_special_tokens=False)]
    answer.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    prompts = [
        renderer.build_generation_prompt(
            [*_EXAMPLE, {"role": "user", "content": row["question"] + _SUFFIX}]
        ).to_ints()
        for row in GSM8K
    ]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = torch.zeros(())
        for prompt in prompts:
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[
                0, len(prompt) - 1 : -1
            ]
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None])
            loss = loss - logp.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)


@contextmanager
def offline_cookbook(folder: Path) -> Iterator[None]:
    """The cookbook's tokenizer for `MODEL_NAME` from ``folder`` (its own registry), and
    ``datasets.load_dataset`` answering the two datasets the loop scripts load with local rows."""
    import datasets
    import transformers
    from tinker_cookbook import tokenizer_utils

    def load_dataset(name: str, *args: Any, **kwargs: Any) -> datasets.DatasetDict:
        rows = {"HuggingFaceH4/no_robots": [{"messages": m} for m in NO_ROBOTS]}
        rows["openai/gsm8k"] = GSM8K
        if name not in rows:
            raise AssertionError(f"the test has no local rows for dataset {name!r}")
        return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[name])})

    real = datasets.load_dataset
    tokenizer_utils.register_tokenizer(
        MODEL_NAME, lambda: transformers.AutoTokenizer.from_pretrained(folder)
    )
    datasets.load_dataset = load_dataset
    try:
        yield
    finally:
        datasets.load_dataset = real
        tokenizer_utils.unregister_tokenizer(MODEL_NAME)
