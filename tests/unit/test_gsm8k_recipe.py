"""examples/gsm8k.yaml end to end on the CPU: a GSM8K-format Parquet file (question, answer
ending "#### N") and a chat-templated tokenizer, both built here, through the column mapping
and the chat template, scored by the gsm8k reward, for two RL steps that log the reward; and
the recipe's committed sample is what examples/make_gsm8k_sample.py writes."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install unirl[deepspeed])")
pytest.importorskip("pyarrow", reason="needs pyarrow (pip install unirl[datasets])")

from unirl.core.run.metrics_log import read_metrics
from unirl.rollouts.data.hf_tokenizer import char_tokenizer_to_hf, save_hf_tokenizer
from unirl.rollouts.data.tokenizer import CharTokenizer

ROOT = Path(__file__).parents[2]
RECIPE = ROOT / "examples" / "gsm8k.yaml"
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
HELD_OUT = [
    {"question": f"Tom has {a} cats and {b} dogs. How many pets?",
     "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
    for a, b in [(2, 2), (7, 1)]
]  # fmt: skip
ROWS = [
    {"question": f"Tom has {a} cats and {b} dogs. How many pets?",
     "answer": f"{a}+{b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
    for a, b in [(2, 3), (4, 1), (6, 2), (3, 3), (5, 4), (1, 7)]
]  # fmt: skip


def _sample_module():
    spec = importlib.util.spec_from_file_location(
        "make_gsm8k", ROOT / "examples" / "make_gsm8k_sample.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_trains_on_a_gsm8k_parquet_with_a_chat_template(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    pq.write_table(pa.table({k: [r[k] for r in ROWS] for k in ("question", "answer")}),
                   tmp_path / "train.parquet")  # fmt: skip
    pq.write_table(pa.table({k: [r[k] for r in HELD_OUT] for k in ("question", "answer")}),
                   tmp_path / "test.parquet")  # fmt: skip
    system = _sample_module().SYSTEM_PROMPT  # the recipe's system prompt
    texts = [r[k] for r in ROWS for k in r] + [TEMPLATE, system, "systemuserassistant"]
    hf = char_tokenizer_to_hf(CharTokenizer.from_texts(texts))
    hf.chat_template = TEMPLATE
    save_hf_tokenizer(hf, tmp_path / "tok")
    assert len(hf) <= 64  # the recipe's vocab_size
    run = tmp_path / "run"
    sets = [f"rollout.prompts={tmp_path / 'train.parquet'}", f"model.tokenizer={tmp_path / 'tok'}",
            "train.rl_steps=2", "batch.prompts_per_rollout=4", "batch.samples_per_prompt=2",
            "batch.samples_per_optimizer_step=8", "batch.micro_batch_size=8",
            "rollout.max_new_tokens=8", "logging.tensorboard=false", f"logging.run_dir={run}",
            f"eval.prompts={tmp_path / 'test.parquet'}", "eval.every=1", "eval.samples_per_prompt=2"]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "unirl.cli", "train", str(RECIPE), *[a for s in sets for a in ("--set", s)]],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows if "loss" in r)
    # the held-out split evaluated after each step (eval.every=1): 2 prompts x 2 samples
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert all(r["eval/prompts"] == 2.0 and 0.0 <= r["eval/pass@2"] <= 1.0 for r in evals)
    # The export carries the chat-templated tokenizer the prompts went through.
    exported = AutoTokenizer.from_pretrained(str(run / "hf"))
    assert exported.chat_template == TEMPLATE
    # The prompt the policy saw, written from the template by hand: system prompt first.
    q = ROWS[0]["question"]
    expected = hf(f"[system]{system}\n[user]{q}\n[assistant]", add_special_tokens=False)
    got = exported.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )  # fmt: skip
    assert got == expected["input_ids"]


def test_the_committed_sample_is_what_the_script_writes(tmp_path):
    import pyarrow.parquet as pq

    _sample_module().write_sample(tmp_path, n=200, seed=0)
    sample = ROOT / "examples" / "gsm8k_sample"
    for split in ("train", "test"):
        assert (pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
                == pq.read_table(sample / f"{split}.parquet").to_pylist())  # fmt: skip
    train_q = {r["question"] for r in pq.read_table(sample / "train.parquet").to_pylist()}
    test_q = [r["question"] for r in pq.read_table(sample / "test.parquet").to_pylist()]
    assert len(test_q) == 40 and not train_q & set(test_q)  # held out
    for name in ("tokenizer.json", "tokenizer_config.json"):
        got = json.loads((tmp_path / "tokenizer" / name).read_text())
        assert got == json.loads((sample / "tokenizer" / name).read_text()), name
    rows = pq.read_table(sample / "train.parquet").to_pylist()
    assert all(set(r) == {"question", "answer"} and "\n#### " in r["answer"] for r in rows)


def test_the_readme_real_model_form_is_a_valid_config():
    """The real-model changes of docs/getting-started/real-model.md applied to the recipe (model.hf_config and
    model.tokenizer dropped, as it says) give a valid config for 8 GPUs."""
    import yaml

    from tests.unit.doc_snippets import doc_snippet
    from unirl.core.config.run_config import config_from_dict

    data = yaml.safe_load(RECIPE.read_text())
    for section, values in yaml.safe_load(
        doc_snippet("getting-started/real-model.md", "gsm8k-real", "yaml")
    ).items():
        data[section] = {**data[section], **values} if isinstance(values, dict) else values
    del data["model"]["hf_config"], data["model"]["tokenizer"]
    pytest.importorskip("wandb", reason="the snippet logs to W&B")
    cfg = config_from_dict(data, world_size=8)
    assert cfg.rollout.reward == "gsm8k" and cfg.rollout.prompt_key == "question"
    assert cfg.model.path == "/models/Qwen2.5-1.5B-Instruct" and cfg.layout.dp == 8
