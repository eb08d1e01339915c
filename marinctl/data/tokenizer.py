"""Tokenizers: a file-free byte-level one (the tiny recipe's), any HF `tokenizer.json`, or one trained here.

Every tokenizer encodes text *without* special tokens; the store writer wraps each document as
`<bos> … <eos>` itself (Levanter's enforce_bos/enforce_eos), so a document split into pieces for memory
(a 50 MB line) gets exactly one pair, and the loader's loss mask can rely on the convention.
Special-token strings that occur in the text are encoded as plain text, never as the special id: a web
page quoting "<|endoftext|>" must not end its own document.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from marinctl.errors import UserError

# Names under which tokenizer.json files commonly declare their document delimiters (tokenizer.json has
# no standard field for them; tokenizer_config.json does, but the contract is one file).
_BOS_NAMES = ("<bos>", "<|begin_of_text|>", "<s>", "<|startoftext|>", "[BOS]")
_EOS_NAMES = ("<eos>", "<|end_of_text|>", "<|endoftext|>", "</s>", "[EOS]")
_PAD_NAMES = ("<pad>", "<|finetune_right_pad_id|>", "[PAD]")

TRAINED_SPECIALS = ("<bos>", "<eos>", "<pad>")


class Tokenizer(Protocol):
    name: str  # "byte" or the tokenizer.json path as given
    identity: str  # what a store records: "byte-v1" or "sha256:<hex of tokenizer.json>"
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """One unsigned/signed integer id array per text (dtype may be narrow), no special tokens added."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


@dataclass(frozen=True)
class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes, then <bos>=256, <eos>=257, <pad>=258 (vocab 259 ≤ tiny's 264)."""

    name: str = "byte"
    identity: str = "byte-v1"
    vocab_size: int = 259
    bos_id: int | None = 256
    eos_id: int | None = 257
    pad_id: int | None = 258

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # uint16, not int32: a 50 MB document costs 100 MB of ids, not 200 MB.
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from one tokenizer.json (e.g. Llama-3's for the hero)."""

    name: str
    identity: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    hf: object = field(repr=False, compare=False)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # Rust-side parallel batch encoding; "fast" skips character offsets, which we never use.
        encodings = self.hf.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """`"byte"` or a path to an HF tokenizer.json; a bad path or file is a one-line UserError."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"{path}: no such tokenizer file (give a tokenizer.json path or 'byte')")
    from tokenizers import Tokenizer as HF

    try:
        raw = path.read_bytes()
        hf = HF.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"{path}: not a valid tokenizer.json ({_first_line(err)})") from None
    hf.encode_special_tokens = True  # literal "<eos>" in a document stays text (module docstring)
    vocab = hf.get_vocab(with_added_tokens=True)
    return HFTokenizer(
        name=str(path),
        identity="sha256:" + hashlib.sha256(raw).hexdigest(),
        vocab_size=hf.get_vocab_size(with_added_tokens=True),
        bos_id=_first_present(vocab, _BOS_NAMES),
        eos_id=_first_present(vocab, _EOS_NAMES),
        pad_id=_first_present(vocab, _PAD_NAMES),
        hf=hf,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: Path) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style: lossless on any text) with <bos>/<eos>/<pad>, save, reload."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    floor = 256 + len(TRAINED_SPECIALS)
    if vocab_size < floor:
        raise UserError(f"--train-tokenizer {vocab_size}: must be ≥ {floor} (256 byte symbols + specials)")
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(TRAINED_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    hf.save(str(tmp))
    tmp.replace(out_path)  # atomic: a killed run never leaves a half-written tokenizer.json
    return load_tokenizer(out_path)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding every id: the byte and 65k vocabularies store 2 bytes per token."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _first_present(vocab: dict[str, int], names: Sequence[str]) -> int | None:
    return next((vocab[n] for n in names if n in vocab), None)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
