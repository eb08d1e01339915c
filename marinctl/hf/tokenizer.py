"""Tokenizer files of a Hugging Face–style export.

For `data.tokenizer = "byte"` the export carries a byte-level `tokenizer.json` built here with the
`tokenizers` library: a BPE with the 256 GPT-2 byte symbols as its vocabulary and no merges, so id b is
byte b exactly as marinctl's `ByteTokenizer` numbers them, then `<bos>`=256, `<eos>`=257, `<pad>`=258.
Any UTF-8 text round-trips (the ByteLevel decoder maps the symbols back to bytes). For a tokenizer.json
recipe the file is copied as is. `tokenizer_config.json` names the special tokens for transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marinctl.data.tokenizer import ByteTokenizer, load_tokenizer
from marinctl.errors import UserError
from marinctl.recipe import Recipe

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (the one `tokenizers`' ByteLevel uses):
    printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """tokenizer.json text equivalent to `ByteTokenizer` (ids, specials, lossless decoding)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    byte = ByteTokenizer()
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    specials = ["<bos>", "<eos>", "<pad>"]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ids = [hf.token_to_id(t) for t in specials]
    if ids != [byte.bos_id, byte.eos_id, byte.pad_id]:
        raise AssertionError(f"byte tokenizer specials got ids {ids}")
    # Documents were trained as <bos> ... <eos>: transformers' add_special_tokens=True prefixes <bos>.
    hf.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", byte.bos_id)]
    )
    return hf.to_str(pretty=True)


def check_tokenizer(recipe: Recipe) -> None:
    """The tokenizer an hf export must carry exists (a one-line UserError otherwise)."""
    spec = recipe.data.tokenizer
    if spec != "byte" and not Path(spec).is_file():
        raise UserError(f"data.tokenizer = {spec!r}: no such tokenizer file; an hf export needs the tokenizer")


def write_tokenizer_files(recipe: Recipe, out: Path) -> dict[str, int | None]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`; return the special
    token ids ({"bos": ..., "eos": ..., "pad": ...}). A tokenizer file the recipe names but that is
    missing is the user's error."""
    spec = recipe.data.tokenizer
    if spec == "byte":
        text = byte_tokenizer_json()
        tok: Any = ByteTokenizer()
    else:
        check_tokenizer(recipe)
        path = Path(spec)
        tok = load_tokenizer(path)
        text = path.read_text()
    if tok.vocab_size > recipe.model.vocab_size:
        raise UserError(f"data.tokenizer: {tok.vocab_size} tokens exceed model.vocab_size={recipe.model.vocab_size}")
    (out / TOKENIZER_FILE).write_text(text)
    names = _special_names(text, tok)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": recipe.train.seq_len,
        "clean_up_tokenization_spaces": False,
        **{f"{k}_token": v for k, v in names.items() if v is not None},
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    special_map = {f"{k}_token": v for k, v in names.items() if v is not None}
    (out / SPECIAL_TOKENS_FILE).write_text(json.dumps(special_map, indent=2) + "\n")
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}


def _special_names(text: str, tok: Any) -> dict[str, str | None]:
    """The strings of the bos/eos/pad ids, read from the tokenizer.json's added tokens."""
    added = {t["id"]: t["content"] for t in json.loads(text).get("added_tokens", [])}
    return {"bos": added.get(tok.bos_id), "eos": added.get(tok.eos_id), "pad": added.get(tok.pad_id)}
