"""Readers: input files → a stream of document *pieces*, in bounded memory, with hostile input counted.

Inputs and what a document is:
- plain text (any file that is not JSONL or Parquet, optionally `.gz`/`.zst`): the whole file is one
  document;
- JSONL (`.jsonl`, `.jsonl.gz`, `.jsonl.zst`): one document per line, the string at `text_field`;
- Parquet (`.parquet`): one document per row of the `text_field` column (string or binary).
Folders are walked recursively in sorted order; hidden entries (a name starting with ".") are skipped.

A document longer than `PIECE_BYTES` (bytes of a text file; characters of a JSON/Parquet string) is
yielded as several pieces, cut before a whitespace near the limit, else at a UTF-8 character boundary.
Pieces are encoded independently, so a subword merge can never span a cut (a deviation from encoding
the document whole, confined to one boundary per MiB). A 50 MB single-line text file streams 1 MiB at a time;
the writer concatenates the pieces' tokens into one document. (A 50 MB JSONL line must be parsed whole,
so it costs a few times its size; its text is still encoded piece by piece.)

Hostile input, and what happens (the tokenize stage documents the same):
- invalid UTF-8 (or lone surrogates from JSON escapes): decoded with U+FFFD replacement and the piece
  flagged; the writer keeps (policy "replace") or drops (policy "skip") the document and counts it;
- an empty or whitespace-only document: the writer skips and counts it;
- a malformed or unreadable file (NUL bytes in a text file's first 8 KiB = binary, bad JSON, missing
  field, truncated gzip/zstd, broken Parquet, I/O error): `BadFile` naming the reason; documents read
  from the file before the error are kept.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import zstandard

from marinctl.errors import UserError

PIECE_BYTES = 1 << 20  # largest piece handed to the tokenizer; bounds memory per document
_WHITESPACE_LOOKBACK = 1 << 16  # how far back from the limit a piece may end to cut before whitespace
_BINARY_SNIFF = 8192

Kind = Literal["text", "jsonl", "parquet"]


class BadFile(Exception):
    """A file that cannot be read as what its name says; the message is one line naming the reason."""


@dataclass(frozen=True)
class Piece:
    text: str
    nbytes: int  # UTF-8 bytes of `text` (the denominator of bits per byte)
    last: bool  # the last piece of its record (a record is one document, possibly empty)
    invalid_utf8: bool  # the raw bytes were not valid UTF-8 (text holds U+FFFD replacements)


@dataclass(frozen=True)
class InputFile:
    path: Path
    display: str  # as the user spelled it (errors and the manifest name files this way)
    kind: Kind
    compression: Literal["", "gzip", "zstd"]
    size: int

    def describe(self) -> dict:
        return {
            "path": self.display,
            "kind": self.kind,
            "compression": self.compression,
            "size": self.size,
            "sha256": file_sha256(self.path),
        }


@dataclass(frozen=True)
class MemoryInput:
    """Documents that live in memory (the built-in corpus's documentation topics)."""

    name: str
    documents: tuple[str, ...]

    @property
    def display(self) -> str:
        return self.name

    @property
    def size(self) -> int:
        return sum(len(d.encode("utf-8")) for d in self.documents)

    def describe(self) -> dict:
        digest = hashlib.sha256()
        for doc in self.documents:
            data = doc.encode("utf-8")
            digest.update(len(data).to_bytes(8, "little") + data)
        return {"path": self.name, "kind": "memory", "compression": "", "size": self.size, "sha256": digest.hexdigest()}


Input = InputFile | MemoryInput


def classify(path: Path) -> tuple[Kind, Literal["", "gzip", "zstd"]]:
    name = path.name.lower()
    compression: Literal["", "gzip", "zstd"] = ""
    for suffix, codec in ((".gz", "gzip"), (".zst", "zstd"), (".zstd", "zstd")):
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], codec
            break
    if name.endswith(".jsonl"):
        return "jsonl", compression
    if name.endswith(".parquet") and not compression:
        return "parquet", ""
    return "text", compression


def discover_inputs(paths: Sequence[str | Path]) -> list[InputFile]:
    """Expand files and folders (recursively, sorted, hidden entries skipped) into input files."""
    found: list[InputFile] = []
    seen: set[Path] = set()

    def add(path: Path, display: str) -> None:
        resolved = path.resolve()
        if resolved in seen:
            return
        seen.add(resolved)
        kind, compression = classify(path)
        found.append(InputFile(resolved, display, kind, compression, resolved.stat().st_size))

    for given in paths:
        root = Path(given)
        if root.is_file():
            add(root, str(given))
        elif root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                for name in sorted(filenames):
                    path = Path(dirpath) / name
                    if not name.startswith(".") and path.is_file():
                        add(path, str(path))
        else:
            raise UserError(f"{given}: no such file or directory")
    if not found:
        raise UserError(f"no input files in {', '.join(str(p) for p in paths)}")
    return found


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class Reader:
    """Pieces of one input, resumable at a record boundary; `position` is raw bytes consumed (progress)."""

    def __init__(self, source: Input, *, text_field: str = "text"):
        self.source, self.text_field, self.position = source, text_field, 0
        self._raw: BinaryIO | None = None

    def pieces(self, skip_records: int = 0) -> Iterator[Piece]:
        """Yield pieces from record `skip_records` on; reading errors surface as `BadFile`."""
        src = self.source
        if isinstance(src, MemoryInput):
            for doc in src.documents[skip_records:]:
                yield from _split_text(doc)
                self.position += len(doc)
            return
        try:
            if src.kind == "parquet":
                yield from self._parquet(skip_records)
                return
            with open(src.path, "rb") as raw:
                self._raw = raw
                stream = _decompressed(raw, src.compression)
                if src.kind == "jsonl":
                    yield from self._jsonl(stream, skip_records)
                elif skip_records == 0:
                    yield from self._text(stream)
        except BadFile:
            raise
        except (OSError, EOFError, zlib.error, zstandard.ZstdError, UnicodeError, ValueError) as err:
            raise BadFile(_describe_error(err, src.compression)) from None
        finally:
            self.position = src.size

    def _tell(self) -> None:
        if self._raw is not None:
            self.position = self._raw.tell()

    def _text(self, stream: BinaryIO) -> Iterator[Piece]:
        buf = stream.read(PIECE_BYTES)
        if b"\x00" in buf[:_BINARY_SNIFF]:
            raise BadFile("binary file (NUL bytes), not text")
        eof = False
        while True:
            while not eof and len(buf) <= PIECE_BYTES:
                block = stream.read(PIECE_BYTES)
                eof = not block
                buf += block
            self._tell()
            while len(buf) > PIECE_BYTES:  # at most 2 pieces buffered, whatever the line length
                cut = _cut_bytes(buf, PIECE_BYTES)
                yield _decode_piece(buf[:cut], last=False)
                buf = buf[cut:]
            if eof:
                yield _decode_piece(buf, last=True)
                return

    def _jsonl(self, stream: BinaryIO, skip_records: int) -> Iterator[Piece]:
        lineno = 0
        for _ in range(skip_records):
            if not stream.readline():
                return
            lineno += 1
        for line in stream:
            lineno += 1
            self._tell()
            text, invalid = _decode_bytes(line)
            if not text.strip():
                yield Piece("", 0, True, invalid)
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise BadFile(f"line {lineno}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise BadFile(f"line {lineno}: expected a JSON object, got {type(record).__name__}")
            if self.text_field not in record:
                raise BadFile(f"line {lineno}: no field {self.text_field!r}")
            value = record[self.text_field]
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise BadFile(f"line {lineno}: field {self.text_field!r} is {type(value).__name__}, not a string")
            value, bad_escape = _clean_surrogates(value)
            yield from _split_text(value, invalid or bad_escape)

    def _parquet(self, skip_records: int) -> Iterator[Piece]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        src = self.source
        assert isinstance(src, InputFile)
        try:
            pf = pq.ParquetFile(src.path)
            schema = pf.schema_arrow
            if self.text_field not in schema.names:
                raise BadFile(f"no column {self.text_field!r} (columns: {', '.join(schema.names)})")
            column_type = schema.field(self.text_field).type
            is_text = pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            if not (is_text or pa.types.is_binary(column_type) or pa.types.is_large_binary(column_type)):
                raise BadFile(f"column {self.text_field!r} is {column_type}, not string or binary")
            total = max(pf.metadata.num_rows, 1)
            first_group, row = 0, 0  # skip whole row groups without reading them
            while first_group < pf.num_row_groups and row + pf.metadata.row_group(first_group).num_rows <= skip_records:
                row += pf.metadata.row_group(first_group).num_rows
                first_group += 1
            skip = skip_records - row
            groups = list(range(first_group, pf.num_row_groups))
            for batch in pf.iter_batches(batch_size=1024, row_groups=groups, columns=[self.text_field]):
                if skip >= batch.num_rows:
                    row, skip = row + batch.num_rows, skip - batch.num_rows
                    continue
                values = batch.column(0).to_pylist()[skip:]
                row, skip = row + skip, 0
                for value in values:
                    if value is None:
                        value = ""
                    if isinstance(value, bytes):
                        text, invalid = _decode_bytes(value)
                    else:
                        text, invalid = _clean_surrogates(value)
                    yield from _split_text(text, invalid)
                    row += 1
                    self.position = src.size * row // total
        except (pa.ArrowException, OSError) as err:
            raise BadFile(f"not a readable Parquet file ({_first_line(err)})") from None


def _decompressed(raw: BinaryIO, compression: str) -> BinaryIO:
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    if compression == "zstd":
        return io.BufferedReader(_ZstdStream(raw), buffer_size=1 << 20)  # type: ignore[return-value]
    return raw


class _ZstdStream(io.RawIOBase):
    """Streaming zstd that, unlike `stream_reader`, notices a truncated final frame (→ EOFError)."""

    def __init__(self, raw: BinaryIO):
        self._raw, self._ctx = raw, zstandard.ZstdDecompressor()
        self._obj, self._out, self._started = self._ctx.decompressobj(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[override]
        while not self._out:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._started and not self._obj.eof:
                    raise EOFError("zstd stream ended before the end of its frame (truncated file)")
                return 0
            while chunk:
                self._started = True
                self._out += self._obj.decompress(chunk)
                chunk = b""
                if self._obj.eof:  # concatenated frames: continue with a fresh decompressor
                    chunk, self._obj, self._started = self._obj.unused_data, self._ctx.decompressobj(), False
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n


def _decode_bytes(data: bytes) -> tuple[str, bool]:
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def _decode_piece(data: bytes, *, last: bool) -> Piece:
    text, invalid = _decode_bytes(data)
    return Piece(text, len(data) if not invalid else len(text.encode("utf-8")), last, invalid)


def _clean_surrogates(text: str) -> tuple[str, bool]:
    """JSON escapes can smuggle lone surrogates (not encodable as UTF-8): replace them, flag the text."""
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), True


def _cut_bytes(buf: bytes, limit: int) -> int:
    """Where to end a piece near `limit`: before the last whitespace (subword merges rarely cross it)."""
    window_start = max(1, limit - _WHITESPACE_LOOKBACK)
    best = max(buf.rfind(ws, window_start, limit) for ws in (b" ", b"\n", b"\t", b"\r"))
    if best > 0:
        return best
    cut = limit
    while cut > limit - 3 and 0x80 <= buf[cut] < 0xC0:  # never split a UTF-8 character
        cut -= 1
    return cut


def _split_text(text: str, invalid: bool = False) -> Iterator[Piece]:
    """One document → pieces of at most ~PIECE_BYTES characters (cut before whitespace when possible)."""
    if len(text) <= PIECE_BYTES:
        yield Piece(text, len(text.encode("utf-8")), True, invalid)
        return
    start = 0
    while len(text) - start > PIECE_BYTES:
        limit = start + PIECE_BYTES
        window = max(start + 1, limit - _WHITESPACE_LOOKBACK)
        cut = max(text.rfind(ws, window, limit) for ws in (" ", "\n", "\t", "\r"))
        cut = cut if cut > start else limit
        chunk = text[start:cut]
        yield Piece(chunk, len(chunk.encode("utf-8")), False, invalid)
        start = cut
    chunk = text[start:]
    yield Piece(chunk, len(chunk.encode("utf-8")), True, invalid)


def _describe_error(err: BaseException, compression: str) -> str:
    if isinstance(err, EOFError | zlib.error | zstandard.ZstdError) or (
        compression == "gzip" and isinstance(err, gzip.BadGzipFile)
    ):
        return f"truncated or corrupt {compression or 'compressed'} data ({_first_line(err)})"
    if isinstance(err, OSError):
        return f"cannot read ({err.strerror or _first_line(err)})"
    return _first_line(err)


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
