"""Tokenizers: the byte-level one needs no files and is lossless; HF ones load by path or are trained here."""

import json

import numpy as np
import pytest

from marinctl.data.tokenizer import ByteTokenizer, load_tokenizer, token_dtype, train_tokenizer
from marinctl.errors import UserError

TEXTS = [
    "plain ASCII text.\n",
    "Ünïcödé — 日本語のテキスト, emoji 🐍🚀, math ∑∫√, RTL שלום",
    "",
    "  leading and trailing whitespace \t\r\n",
    "a literal <eos> and <|endoftext|> inside the text stay text",
]


def test_byte_tokenizer_round_trips_any_unicode_and_uses_utf8_bytes_as_ids():
    tok = ByteTokenizer()
    for text, ids in zip(TEXTS, tok.encode_batch(TEXTS), strict=True):
        assert ids.tolist() == list(text.encode("utf-8"))  # oracle: the UTF-8 bytes themselves
        assert tok.decode(ids) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)


def test_byte_vocab_fits_the_tiny_recipe(tiny_recipe):
    assert load_tokenizer(tiny_recipe.data.tokenizer).vocab_size <= tiny_recipe.model.vocab_size


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    corpus = [t * 3 for t in TEXTS] + ["def f(x):\n    return x + 1\n" * 20, "The quick brown fox. " * 30]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer(iter(corpus), 320, path), corpus, path


def test_trained_tokenizer_round_trips_its_documents_and_merges(trained):
    tok, corpus, _ = trained
    encoded = tok.encode_batch(corpus)
    for text, ids in zip(corpus, encoded, strict=True):
        assert tok.decode(ids) == text
    assert sum(map(len, encoded)) < sum(len(t.encode()) for t in corpus)  # BPE merges actually compress
    assert tok.vocab_size == 320 and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)


def test_special_token_strings_in_text_are_not_encoded_as_specials(trained):
    tok, _, _ = trained
    (ids,) = tok.encode_batch(["before <eos> after <bos>"])
    assert tok.eos_id not in ids.tolist() and tok.bos_id not in ids.tolist()


def test_hf_tokenizer_loads_by_path_with_a_content_hash(trained):
    tok, _, path = trained
    again = load_tokenizer(path)
    assert again.identity == tok.identity and again.identity.startswith("sha256:")
    assert [a.tolist() for a in again.encode_batch(TEXTS)] == [b.tolist() for b in tok.encode_batch(TEXTS)]


def test_missing_or_malformed_tokenizer_file_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(UserError, match=r"bad\.json: not a valid tokenizer\.json") as err:
        load_tokenizer(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="must be ≥ 259"):
        train_tokenizer(iter(["x"]), 100, tmp_path / "t.json")


def test_token_dtype_is_the_smallest_that_holds_every_id():
    assert token_dtype(259) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32
