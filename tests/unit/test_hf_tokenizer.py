"""The character tokenizer as a Hugging Face tokenizer: the same ids as `CharTokenizer` on many
strings, saved and reloaded by `AutoTokenizer`, and the adapter a prompt task uses."""

import json
import random

import pytest

from unirl.rollouts.data.hf_tokenizer import (
    HFTokenizer,
    char_tokenizer_to_hf,
    load_hf_tokenizer,
    save_hf_tokenizer,
)
from unirl.rollouts.data.tasks import DIGITS
from unirl.rollouts.data.tokenizer import CharTokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# Letters, digits, punctuation, a space, a newline, a tab and the characters of the special
# tokens' names (so a text can spell "<eos>": it must stay characters, as CharTokenizer keeps it).
WIDE = "abcdefghijklmnopqrstuvwxyzABC0123456789 .,:?!+-*/=()<>\n\t'\"_#"


def random_strings(alphabet, n, seed):
    rng = random.Random(seed)
    out = ["", alphabet, "<eos>", "a<sep>b<bos>", "  \n\n ", "<pad><unk>"]
    out = [s for s in out if all(c in alphabet for c in s)]
    out += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    return out


@pytest.mark.parametrize("alphabet", [DIGITS, DIGITS + "+", WIDE])
def test_ids_equal_char_tokenizer_on_many_strings(alphabet):
    char = CharTokenizer(alphabet)
    hf = char_tokenizer_to_hf(char)
    assert len(hf) == char.vocab_size
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.sep_token_id) == (0, 1, 2, 3)
    for text in random_strings(alphabet, 300, seed=len(alphabet)):
        plain = char.encode(text)
        assert hf.encode(text, add_special_tokens=False) == plain, text
        # With special tokens: a prompt framed <bos> text <sep>, exactly CharTokenizer's.
        assert hf(text)["input_ids"] == char.encode(text, bos=True, sep=True), text
        assert hf.decode(plain) == text
        framed = char.encode(text, bos=True, sep=True) + char.encode(text, eos=True)
        assert hf.decode(framed, skip_special_tokens=True) == char.decode(framed)


def test_saved_tokenizer_loads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    char = CharTokenizer(WIDE)
    save_hf_tokenizer(char_tokenizer_to_hf(char), tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in random_strings(WIDE, 100, seed=7):
        assert loaded(text)["input_ids"] == char.encode(text, bos=True, sep=True)
        assert loaded.encode(text, add_special_tokens=False) == char.encode(text)
    assert loaded.eos_token_id == 2 and len(loaded) == char.vocab_size


def test_adapter_decodes_like_char_tokenizer_beyond_the_vocabulary(tmp_path):
    char = CharTokenizer(DIGITS)
    tok = HFTokenizer(char_tokenizer_to_hf(char), key="test")
    assert (tok.vocab_size, tok.eos_id) == (14, 2)
    assert tok.special_token_ids() == char.special_token_ids()
    # Ids 14 and 31 lie beyond the 14-token vocabulary (a model with more rows may emit them).
    ids = [1, 5, 14, 6, 31, 2]
    assert tok.decode(ids) == char.decode(ids) == "1<unk:14>2<unk:31>"
    assert tok.encode_prompt("307") == char.encode("307", bos=True, sep=True)


def test_load_names_the_key_when_the_folder_has_no_tokenizer(tmp_path):
    from unirl.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.tokenizer=.*holds no tokenizer files"):
        load_hf_tokenizer(str(tmp_path / "missing"), key="model.tokenizer")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.path=.*AutoTokenizer cannot load it") as err:
        load_hf_tokenizer(str(tmp_path), key="model.path")
    assert "\n" not in str(err.value)
