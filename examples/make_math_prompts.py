"""Write arithmetic word problems with exact integer answers as a unirl prompt file (JSONL).

    python examples/make_math_prompts.py                          # examples/math_prompts.jsonl
    python examples/make_math_prompts.py --n 2000 --seed 1 --out my_prompts.jsonl

Each line is ``{"prompt": "...", "metadata": {"answer": N, "kind": "..."}}``: one of six
templates (add, take away, groups of, share equally, price times count, two steps) with small
operands (every answer is an integer from 0 to 45), names and items drawn from short lists, all
from one seeded `random.Random`, so a seed gives the same file on every machine. The prompt ends
with "Answer:" so a response that is just the number reads naturally; ``rollout.reward:
math_answer`` scores it. Every problem is distinct. Small numbers keep the set within reach of
the tiny demo models; the file is a test of the plumbing (text prompts, metadata, a reward that
parses an answer), not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ("Ann", "Ben", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal", "Ivy", "Joe", "Kim", "Lou")
ITEMS = ("apple", "pen", "book", "card", "egg", "shell", "coin", "cup")


def _add(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have?", a + b


def _take_away(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a = rng.randint(2, 30)
    b = rng.randint(1, a)
    return f"{name} had {a} {item}s and gave away {b}. How many {item}s are left?", a - b


def _groups(rng: random.Random) -> tuple[str, int]:
    item = rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 5)
    return f"There are {a} boxes with {b} {item}s in each. How many {item}s are there?", a * b


def _share(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    each, friends = rng.randint(1, 9), rng.randint(2, 5)
    return (
        f"{name} shares {each * friends} {item}s equally among {friends} friends. How many "
        f"does each friend get?",
        each,
    )


def _price(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 9), rng.randint(1, 5)
    return (
        f"{name} buys {count} {item}s at {price} dollars each. How many dollars does {name} pay?",
        count * price,
    )


def _two_steps(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(1, 15), rng.randint(1, 15)
    c = rng.randint(1, a + b)
    return (
        f"{name} has {a} {item}s, finds {b} more and loses {c}. How many {item}s are left?",
        a + b - c,
    )


KINDS: dict[str, Callable[[random.Random], tuple[str, int]]] = {
    "add": _add,
    "take_away": _take_away,
    "groups": _groups,
    "share": _share,
    "price": _price,
    "two_steps": _two_steps,
}


def make_problems(n: int, seed: int) -> list[dict]:
    """``n`` distinct problems, kinds in turn, drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    kinds = list(KINDS.items())
    seen: set[str] = set()
    records = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 100 * n:
            raise SystemExit(f"could not draw {n} distinct problems; ask for fewer")
        kind, make = kinds[len(records) % len(kinds)]
        question, answer = make(rng)
        if question in seen:
            continue
        seen.add(question)
        records.append(
            {"prompt": f"{question} Answer:", "metadata": {"answer": answer, "kind": kind}}
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=384, help="number of problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).with_name("math_prompts.jsonl")), help="JSONL path"
    )
    args = parser.parse_args()
    records = make_problems(args.n, args.seed)
    with open(args.out, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"wrote {len(records)} problems to {args.out}")


if __name__ == "__main__":
    main()
