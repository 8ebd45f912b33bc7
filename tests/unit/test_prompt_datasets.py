"""Prompt datasets beyond JSONL and chat prompts: Parquet files and Hugging Face datasets
folders through the column mapping (rollout.prompt_key / answer_key / metadata_keys), chat
messages through a chat template (built here, nothing downloaded), the system prompt, the row
checks naming row, field and fix, and resume on a Parquet file."""

import logging

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install unirl[hf])")
pytest.importorskip("pyarrow", reason="needs pyarrow (pip install unirl[datasets])")

from tests.unit.test_prompts import assert_resumes_where_it_stopped, make_cfg, write_prompts
from unirl.core.config.run_config import config_from_dict
from unirl.core.errors import ConfigError, RolloutDataError
from unirl.rollouts.build import build_task
from unirl.rollouts.data.hf_tokenizer import char_tokenizer_to_hf, save_hf_tokenizer
from unirl.rollouts.data.tokenizer import CharTokenizer

# A tiny chat template in the style of real ones: role markers, the assistant's turn opened by
# add_generation_prompt.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789+=?;<>|# "


pytestmark = pytest.mark.usefixtures("one_thread")


def chat_tokenizer(folder):
    """A character-level Hugging Face tokenizer with TEMPLATE, saved to ``folder``."""
    hf = char_tokenizer_to_hf(CharTokenizer(ALPHABET))
    hf.chat_template = TEMPLATE
    save_hf_tokenizer(hf, folder)
    return folder


def char_ids(text):
    """The ids of ``text`` in the tokenizer above, written from its rule (4 special ids, then
    the alphabet's characters in the order given), without its special tokens."""
    return [4 + ALPHABET.index(c) for c in text]


def gsm8k_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({k: [r[k] for r in rows] for k in ("question", "answer")}), path)
    return path


GSM = [
    {"question": "1+2=?", "answer": "1+2=3 #### 3"},
    {"question": "2+2=?", "answer": "2+2=4 #### 4"},
    {"question": "3+5=?", "answer": "3+5=8 #### 8"},
]
MAPPING = {"prompt_key": "question", "answer_key": "answer", "reward": "gsm8k"}
LONGER = {"max_seq_len": 64, "hf_config": {"model_type": "llama",
          "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}}  # fmt: skip


def test_parquet_through_the_column_mapping_and_the_chat_template(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    path = gsm8k_parquet(tmp_path / "train.parquet", GSM)
    rollout = {**MAPPING, "apply_chat_template": True, "system_prompt": "add"}
    task = build_task(make_cfg(path, rollout=rollout, model={**LONGER, "tokenizer": str(tok)}))
    by_origin = {p.origin: p for p in task.problems}
    for i, row in enumerate(GSM):
        p = by_origin[f"{path} row {i}"]
        rendered = f"<|system|>add;<|user|>{row['question']};<|assistant|>"
        assert list(p.prompt_tokens) == char_ids(rendered)
        assert p.metadata == {"answer": row["answer"]}


def test_messages_rows_keep_their_own_system_message(tmp_path):
    tok = chat_tokenizer(tmp_path / "tok")
    rows = [
        {"messages": [{"role": "user", "content": "1+1=?"}], "metadata": {"answer": 2}},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "2+1=?"}], "metadata": {"answer": 3}},
    ]  # fmt: skip
    path = write_prompts(tmp_path / "p.jsonl", rows)
    cfg = make_cfg(path, rollout={"system_prompt": "add"}, model={**LONGER, "tokenizer": str(tok)})
    by_line = {p.origin.rsplit(" ", 1)[-1]: p for p in build_task(cfg).problems}
    assert list(by_line["1"].prompt_tokens) == char_ids("<|system|>add;<|user|>1+1=?;<|assistant|>")
    assert list(by_line["2"].prompt_tokens) == char_ids(
        "<|system|>be brief;<|user|>2+1=?;<|assistant|>"
    )


def test_datasets_folders_saved_with_save_to_disk(tmp_path):
    datasets = pytest.importorskip(
        "datasets", reason="needs datasets (pip install unirl[datasets])"
    )
    ds = datasets.Dataset.from_list(GSM)
    ds.save_to_disk(str(tmp_path / "one"))
    task = build_task(make_cfg(tmp_path / "one", rollout=MAPPING))
    assert sorted(p.metadata["answer"] for p in task.problems) == sorted(r["answer"] for r in GSM)
    assert {p.origin for p in task.problems} == {f"{tmp_path / 'one'} row {i}" for i in range(3)}
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(ConfigError, match=r"holds the splits \['test', 'train'\]; name one"):
        build_task(make_cfg(tmp_path / "two", rollout=MAPPING))
    task = build_task(make_cfg(tmp_path / "two" / "train", rollout=MAPPING))
    assert len(task.problems) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"is a folder but not a Hugging Face datasets folder"):
        build_task(make_cfg(tmp_path / "empty", rollout=MAPPING))


def test_skipped_long_rows_are_named_as_zero_based_rows(tmp_path, caplog):
    """A Parquet row is named as the dataset indexes it (``row 1``, 0-based), never as a line."""
    long = {"question": "1+" * 40 + "1=?", "answer": "#### 41"}
    path = gsm8k_parquet(tmp_path / "p.parquet", [GSM[0], long, GSM[1]])
    with caplog.at_level(logging.WARNING):
        task = build_task(make_cfg(path, rollout={**MAPPING, "skip_long_prompts": True}))
    assert task.num_prompts == 2 and "rows 1 (0-based)" in caplog.text
    assert "lines" not in caplog.text


@pytest.mark.parametrize(
    ("rows", "rollout", "message"),
    [
        (GSM, {"prompt_key": "text"}, r"row 0: no field 'text' \(rollout.prompt_key\); the row "
         r"has \['answer', 'question'\]; set rollout.prompt_key"),
        (GSM, {**MAPPING, "metadata_keys": ["level"]}, r"row 0: no field 'level' "
         r"\(rollout.metadata_keys\[0\]\)"),
        (GSM, {}, r"row 0: unknown field 'answer'.*needs rollout.prompt_key"),
        ([*GSM[:2], {"question": "", "answer": "#### 1"}], MAPPING,
         r"row 2: field 'question' is ''; give the prompt as a non-empty string"),
        ([*GSM[:1], {"question": None, "answer": "#### 1"}], MAPPING,
         r"row 1: the cell of column 'question' \(rollout.prompt_key\) is empty \(null\); fill "
         r"it or drop the row"),
        ([*GSM[:1], {"question": "1+1?", "answer": None}], MAPPING,
         r"row 1: the cell of column 'answer' \(rollout.answer_key\) is empty"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_row_the_field_and_the_fix(tmp_path, rows, rollout, message):
    path = gsm8k_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(RolloutDataError, match=message):
        build_task(make_cfg(path, rollout={"reward": "gsm8k", **rollout}))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"messages": []}, r"line 2: field 'messages' must be a non-empty list of chat messages"),
        ({"messages": [{"role": "user"}]}, r"line 2: messages\[0\] is .*with \"role\" and"),
        ({"messages": [{"role": "user", "content": 3}]}, r"line 2: messages\[0\] has role"),
        ({"prompt": "1", "messages": [{"role": "user", "content": "x"}]},
         r"line 2: give exactly one of .* found both 'prompt' and 'messages'"),
    ],
)  # fmt: skip
def test_bad_chat_lines(tmp_path, line, message):
    path = write_prompts(tmp_path / "p.jsonl", [{"prompt": "1+1="}, line])
    with pytest.raises(RolloutDataError, match=message):
        build_task(make_cfg(path))


def test_chat_needs_a_template_and_a_system_prompt_needs_chat(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "1+1=?"}], "metadata": {"answer": 2}}]
    path = write_prompts(tmp_path / "chat.jsonl", rows)
    with pytest.raises(ConfigError, match=r"line 1: a chat prompt needs a tokenizer with a chat "
                       r"template.*set model.tokenizer"):  # fmt: skip
        build_task(make_cfg(path, model=LONGER))  # the character tokenizer has none
    text = write_prompts(tmp_path / "text.jsonl", [{"prompt": "1+1=", "metadata": {"answer": 2}}])
    with pytest.raises(ConfigError, match=r"rollout.system_prompt is set, but no prompt .* "
                       r"rollout.apply_chat_template: true"):  # fmt: skip
        build_task(make_cfg(text, rollout={"system_prompt": "x"}))
    no_prompts = {
        "model": {"hf_config": LONGER["hf_config"]},
        "batch": {"micro_batch_size": 32},
        "parallel": {"world_size": 1},
    }
    for key, value in [("prompt_key", "question"), ("answer_key", "answer"),
                       ("apply_chat_template", True), ("system_prompt", "x")]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"rollout.{key}=.* applies to prompts read"):
            config_from_dict({**no_prompts, "rollout": {key: value}})


def test_a_parquet_stream_resumes_where_it_stopped(tmp_path):
    rows = [{"question": f"{a}+{a}=?", "answer": f"#### {2 * a}"} for a in range(5)]
    cfg = make_cfg(gsm8k_parquet(tmp_path / "p.parquet", rows), rollout=MAPPING,
                   model=LONGER, prompts_per_rollout=3)  # fmt: skip
    assert_resumes_where_it_stopped(cfg)  # group ids included
