"""Write a small GSM8K-format prompt set and a tiny chat-templated tokenizer, so that
examples/gsm8k.yaml runs on the CPU from a fresh clone with nothing downloaded.

    python examples/make_gsm8k_sample.py            # examples/gsm8k_sample/{train,test}.parquet, tokenizer
    python examples/make_gsm8k_sample.py --n 500 --seed 1 --out /tmp/gsm8k_sample

``train.parquet`` has GSM8K's schema as published (``openai/gsm8k``, config ``main``): a
``question`` column and an ``answer`` column holding a worked solution with calculator
annotations that ends ``#### <number>``; ``test.parquet`` (the recipe's ``eval.prompts``) is a
held-out split in the same schema, problems that are not in the train split. The problems are short one- or two-step word problems
(sums, differences, products), drawn from one seeded `random.Random`, so a seed gives the same
rows on every machine. ``tokenizer/`` is a character-level Hugging Face tokenizer over every
character of the rows, the chat template and examples/gsm8k.yaml's system prompt, with a small
chat template (``<|system|>...<|user|>...<|assistant|>``): the stand-in, for a 2-layer model from
random weights, of an instruct model's own tokenizer. With a real model, point
``rollout.prompts`` at GSM8K's own train Parquet file and ``model.path`` at the model folder
instead (see docs/getting-started/real-model.md).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = ("Ann", "Ben", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal")
ITEMS = ("apple", "pen", "book", "card", "egg", "coin")
# Kept in step with examples/gsm8k.yaml (its characters must be in the tokenizer).
SYSTEM_PROMPT = "Solve it. End with #### and the number."
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def problem(rng: random.Random) -> dict[str, str]:
    """One row: a question and a GSM8K-style solution (<<a+b=c>> annotations, #### answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        question = f"{name} has {a} {item}s and gets {b} more. How many {item}s now?"
        steps, answer = f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}", a + b
    elif kind == 1:
        a = rng.randint(2, 30)
        b = rng.randint(1, a)
        question = f"{name} had {a} {item}s and gave {b} away. How many are left?"
        steps, answer = f"{a}-{b} = <<{a}-{b}={a - b}>>{a - b}", a - b
    else:
        a, b, c = rng.randint(2, 9), rng.randint(2, 5), rng.randint(1, 9)
        question = f"{name} buys {a} bags of {b} {item}s and finds {c} more. How many {item}s?"
        steps = f"{a}*{b} = <<{a}*{b}={a * b}>>{a * b}\n{a * b}+{c} = <<{a * b}+{c}={a * b + c}>>{a * b + c}"
        answer = a * b + c
    return {"question": question, "answer": f"{steps}\n#### {answer}"}


def write_sample(out: Path, n: int, seed: int, n_test: int = 40) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from unirl.rollouts.data.hf_tokenizer import char_tokenizer_to_hf, save_hf_tokenizer
    from unirl.rollouts.data.tokenizer import CharTokenizer

    rng = random.Random(seed)
    rows, seen = [], set()
    # the train rows first, then the held-out ones from the same stream (so the train split
    # does not depend on the test split's size), none of them a train question
    while len(rows) < n + n_test:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    out.mkdir(parents=True, exist_ok=True)
    for name, split in (("train", rows[:n]), ("test", rows[n:])):
        table = pa.table({k: [r[k] for r in split] for k in ("question", "answer")})
        pq.write_table(table, out / f"{name}.parquet")
    texts = [r[k] for r in rows for k in ("question", "answer")]
    texts += [SYSTEM_PROMPT, CHAT_TEMPLATE, "systemuserassistant"]
    hf = char_tokenizer_to_hf(CharTokenizer.from_texts(texts))
    hf.chat_template = CHAT_TEMPLATE
    save_hf_tokenizer(hf, out / "tokenizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="number of problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "gsm8k_sample")
    args = parser.parse_args()
    write_sample(args.out, args.n, args.seed)


if __name__ == "__main__":
    main()
