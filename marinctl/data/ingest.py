"""Tokenize inputs into a store: read (background thread) → batch-encode → append → commit, resumably.

The pipeline is the core of `marinctl tokenize` and of the built-in corpus. Resume works at document
granularity: the manifest's cursor says how many input files are done and how many records of the next
one are committed; a rerun skips exactly those and continues, so a killed-and-rerun store equals an
uninterrupted one token for token. A finished store whose inputs are a prefix of a new input list is
appended to (docs/recipe.md §6: "appendable and resumable").
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import zip_longest
from pathlib import Path
from typing import Literal

from marinctl.data.readers import BadFile, Input, Piece, Reader
from marinctl.data.store import FORMAT, TOKENIZER_FILE, StoreWriter, is_ours, read_manifest, remove_store
from marinctl.data.tokenizer import Tokenizer, token_dtype
from marinctl.errors import UserError

# Test hook: seconds to sleep inside each commit, after the data and before the manifest is written, so
# the kill test can SIGKILL a run in the window where the arrays hold uncommitted data.
COMMIT_SLEEP_ENV = "MARINCTL_TOKENIZE_TEST_COMMIT_SLEEP"


@dataclass(frozen=True)
class IngestOptions:
    text_field: str = "text"
    invalid_utf8: Literal["replace", "skip"] = "replace"
    skip_bad_files: bool = False
    commit_tokens: int = 1 << 22  # commit at the first document boundary after this many new tokens …
    commit_seconds: float = 10.0  # … or after this long
    batch_bytes: int = 4 << 20  # text per encode_batch call

    def identity(self) -> dict:
        """Options that change the stored tokens (a resume must use the same ones)."""
        return {"text_field": self.text_field, "invalid_utf8": self.invalid_utf8}


@dataclass
class Progress:
    documents: int = 0
    tokens: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int = 0
    phase: str = "hashing"


@dataclass
class _Doc:
    dropping: bool = False  # skip policy hit: ignore the rest of this document's pieces
    has_text: bool = False
    invalid: bool = False
    nbytes: int = 0


@dataclass
class _Batch:
    items: list[tuple[int, Piece | str]] = field(default_factory=list)  # (file, piece | "end" | "bad:<why>")
    position: int = 0


def ingest(
    root: str | Path,
    inputs: Sequence[Input],
    tokenizer: Tokenizer,
    options: IngestOptions = IngestOptions(),
    *,
    overwrite: bool = False,
    tokenizer_info: dict | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> dict:
    """Tokenize `inputs` into the store at `root` (create, resume or append); return the summary dict."""
    root, started = Path(root), time.perf_counter()
    progress = Progress(bytes_total=sum(i.size for i in inputs), files_total=len(inputs))
    report = on_progress or (lambda _: None)
    report(progress)
    described = [i.describe() | {"status": "pending", "documents": 0, "records": 0} for i in inputs]
    tok_info = {
        "name": tokenizer.name,
        "identity": tokenizer.identity,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
    } | (tokenizer_info or {})
    opened = _open(root, tok_info, options, described, overwrite=overwrite, keep_tokenizer=bool(tokenizer_info))
    if isinstance(opened, dict):  # already complete with exactly these inputs
        return summary(root, opened, resumed=False, seconds=time.perf_counter() - started, added=(0, 0))
    writer, manifest, resumed = opened
    first = (manifest["documents"], manifest["tokens"])
    appender = _Appender(writer, manifest, tokenizer, options)

    sleep_s = float(os.environ.get(COMMIT_SLEEP_ENV, "0") or 0)
    hook = (lambda: time.sleep(sleep_s)) if sleep_s > 0 else None
    last_commit = time.perf_counter()
    cursor = manifest["cursor"]
    done_bytes = sum(f["size"] for f in manifest["inputs"][: cursor["file"]])
    progress.phase, progress.files_done, progress.bytes_done = "tokenizing", cursor["file"], done_bytes
    progress.documents, progress.tokens = first
    report(progress)
    for batch in _read_batches(inputs, cursor["file"], cursor["records"], options):
        encoded = iter(tokenizer.encode_batch([p.text for _, p in batch.items if isinstance(p, Piece)]))
        for index, item in batch.items:
            if isinstance(item, Piece):
                appender.piece(index, item, next(encoded))
            else:
                done_bytes += appender.file_done(index, item)
                progress.files_done = index + 1
        progress.documents, progress.tokens = writer.documents, writer.tokens
        progress.bytes_done = done_bytes + batch.position
        due = writer.tokens - writer.committed_tokens >= options.commit_tokens
        if not writer.in_document and (due or time.perf_counter() - last_commit >= options.commit_seconds):
            _commit(writer, manifest, hook=hook)
            last_commit = time.perf_counter()
        report(progress)

    manifest["documents"], manifest["tokens"], manifest["complete"] = writer.documents, writer.tokens, True
    manifest["run"]["updated"] = _now()
    writer.finish(manifest)
    progress.phase, progress.bytes_done = "done", progress.bytes_total
    report(progress)
    added = (manifest["documents"] - first[0], manifest["tokens"] - first[1])
    return summary(root, manifest, resumed=resumed, seconds=time.perf_counter() - started, added=added)


class _Appender:
    """Turns pieces and file events into documents in the writer and counts in the manifest."""

    def __init__(self, writer: StoreWriter, manifest: dict, tokenizer: Tokenizer, options: IngestOptions):
        self.writer, self.manifest, self.tokenizer, self.options = writer, manifest, tokenizer, options
        self.doc: _Doc | None = None

    def piece(self, index: int, piece: Piece, ids) -> None:
        doc, m = self.doc, self.manifest
        if doc is None:
            doc = self.doc = _Doc()
            self.writer.begin_document(self.tokenizer.bos_id)
        if not doc.dropping:
            doc.invalid |= piece.invalid_utf8
            if doc.invalid and self.options.invalid_utf8 == "skip":
                doc.dropping = True
            else:
                self.writer.append(ids)
                doc.nbytes += piece.nbytes
                doc.has_text = doc.has_text or (bool(piece.text) and not piece.text.isspace())
        if not piece.last:
            return
        entry = m["inputs"][index]
        if doc.dropping or not doc.has_text:
            self.writer.abort_document()
            m["invalid_utf8" if doc.dropping else "skipped_empty"] += 1
        else:
            self.writer.end_document(self.tokenizer.eos_id)
            m["invalid_utf8"] += int(doc.invalid)
            m["text_bytes"] += doc.nbytes
            entry["documents"] += 1
        entry["records"] += 1
        m["cursor"] = {"file": index, "records": entry["records"]}
        self.doc = None

    def file_done(self, index: int, event: str) -> int:
        """A file ended ("end") or broke ("bad:<why>"); returns its size (bytes now done)."""
        m, entry = self.manifest, self.manifest["inputs"][index]
        if self.doc is not None:  # the file broke in the middle of a document
            self.writer.abort_document()
            self.doc = None
        if event != "end" and not self.options.skip_bad_files:
            # Keep what is complete (the cursor stays on this file: fix it, or skip it, and rerun).
            _commit(self.writer, m)
            why = event.removeprefix("bad:")
            raise UserError(f"{entry['path']}: {why} (pass --skip-bad-files to skip such files)")
        if event == "end":
            entry["status"] = "ok"
        else:
            entry["status"], entry["error"] = "bad", event.removeprefix("bad:")
            m["skipped_files"] += 1
        m["cursor"] = {"file": index + 1, "records": 0}
        return entry["size"]


def _open(
    root: Path, tok_info: dict, options: IngestOptions, described: list[dict], *, overwrite: bool, keep_tokenizer: bool
) -> tuple[StoreWriter, dict, bool] | dict:
    """Create, resume or append; or return the manifest of a store that is already complete."""
    if not is_ours(root):
        raise UserError(f"{root}: exists and is not a marinctl token store (choose another --out)")
    if overwrite:
        remove_store(root, keep=(TOKENIZER_FILE,) if keep_tokenizer else ())
    previous = read_manifest(root)
    if previous is None:
        # A run killed before its first commit committed nothing; a tokenizer trained for it is kept.
        remove_store(root, keep=(TOKENIZER_FILE,))
        manifest = _fresh_manifest(tok_info, options, described, tok_info["vocab_size"])
        writer, resumed = StoreWriter.create(root, token_dtype(tok_info["vocab_size"])), False
    else:
        manifest = _continue_manifest(root, previous, tok_info, options, described)
        if manifest is None:
            return previous
        writer, resumed = StoreWriter.resume(root, previous["documents"], previous["tokens"]), True
    manifest["run"]["sessions"] += 1
    return writer, manifest, resumed


def summary(root: Path, manifest: dict, *, resumed: bool, seconds: float, added: tuple[int, int]) -> dict:
    """The stage's `--json` object (at least documents, tokens, skipped_empty, invalid_utf8, skipped_files)."""
    return {
        "store": str(root),
        "documents": manifest["documents"],
        "tokens": manifest["tokens"],
        "text_bytes": manifest["text_bytes"],
        "skipped_empty": manifest["skipped_empty"],
        "invalid_utf8": manifest["invalid_utf8"],
        "skipped_files": manifest["skipped_files"],
        "bad_files": [{"path": f["path"], "error": f["error"]} for f in manifest["inputs"] if f["status"] == "bad"],
        "files": len(manifest["inputs"]),
        "tokenizer": manifest["tokenizer"]["name"],
        "vocab_size": manifest["tokenizer"]["vocab_size"],
        "complete": manifest["complete"],
        "resumed": resumed,
        "added_documents": added[0],  # by this run (less than documents after a resume or append)
        "added_tokens": added[1],
        "seconds": round(seconds, 3),
    }


def training_texts(inputs: Sequence[Input], options: IngestOptions) -> Iterator[str]:
    """Document pieces for `--train-tokenizer`, with the same bad-input policy as tokenization."""
    for item in _read_batches(inputs, 0, 0, options, queue_batches=False):
        for index, piece in item.items:
            if isinstance(piece, Piece):
                if not (piece.invalid_utf8 and options.invalid_utf8 == "skip"):
                    yield piece.text
            elif piece != "end" and not options.skip_bad_files:
                why = piece.removeprefix("bad:")
                raise UserError(f"{inputs[index].display}: {why} (pass --skip-bad-files to skip such files)")


def _read_batches(
    inputs: Sequence[Input], first_file: int, skip_records: int, options: IngestOptions, *, queue_batches: bool = True
) -> Iterator[_Batch]:
    """Batches of pieces and file events; read by a background thread so I/O overlaps encoding."""

    # Commits happen between batches, so a batch never holds more text than one commit interval.
    batch_bytes = min(options.batch_bytes, options.commit_tokens)

    def produce() -> Iterator[_Batch]:
        batch, size = _Batch(), 0
        for index in range(first_file, len(inputs)):
            reader = Reader(inputs[index], text_field=options.text_field)
            try:
                for piece in reader.pieces(skip_records if index == first_file else 0):
                    batch.items.append((index, piece))
                    size += len(piece.text)
                    if size >= batch_bytes or len(batch.items) >= 16384:
                        batch.position = reader.position
                        yield batch
                        batch, size = _Batch(), 0
                batch.items.append((index, "end"))
            except BadFile as err:
                batch.items.append((index, f"bad:{err}"))
        yield batch

    if not queue_batches:
        yield from produce()
        return
    q: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()
    done = object()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def worker() -> None:
        try:
            for batch in produce():
                if not put(batch):
                    return
            put(done)
        except BaseException as err:  # surfaced in the consumer, not lost in the thread
            put(err)

    thread = threading.Thread(target=worker, name="marinctl-tokenize-reader", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)


def _commit(writer: StoreWriter, manifest: dict, *, hook: Callable[[], None] | None = None) -> None:
    manifest["documents"], manifest["tokens"] = writer.documents, writer.tokens
    manifest["run"]["updated"] = _now()
    writer.commit(manifest, before_manifest=hook)


def _fresh_manifest(tok_info: dict, options: IngestOptions, described: list[dict], vocab_size: int) -> dict:
    return {
        "format": FORMAT,
        "complete": False,
        "tokenizer": tok_info,
        "options": options.identity(),
        "dtype": token_dtype(vocab_size).name,
        "documents": 0,
        "tokens": 0,
        "text_bytes": 0,
        "skipped_empty": 0,
        "invalid_utf8": 0,
        "skipped_files": 0,
        "cursor": {"file": 0, "records": 0},
        "inputs": described,
        "run": {"created": _now(), "updated": _now(), "sessions": 0},
    }


def _continue_manifest(
    root: Path, previous: dict, tok_info: dict, options: IngestOptions, described: list[dict]
) -> dict | None:
    """Resume/append check: same tokenizer and options, and the committed inputs unchanged."""
    hint = "pass --overwrite to rebuild, or choose another --out"
    if previous["tokenizer"]["identity"] != tok_info["identity"]:
        raise UserError(f"{root}: store was made with tokenizer {previous['tokenizer']['name']!r}; {hint}")
    if previous["options"] != options.identity():
        raise UserError(f"{root}: store was made with options {previous['options']}; {hint}")
    cursor = previous["cursor"]
    fixed = cursor["file"] + (1 if cursor["records"] else 0)  # inputs whose committed content is on disk
    key = ("path", "size", "sha256")
    old = [tuple(f[k] for k in key) for f in previous["inputs"][:fixed]]
    new = [tuple(f[k] for k in key) for f in described[:fixed]]
    if old != new:
        changed = next(o[0] for o, n in zip_longest(old, new) if o != n)
        raise UserError(f"{root}: input {changed} changed or is missing since it was tokenized; {hint}")
    same = [tuple(f[k] for k in key) for f in previous["inputs"]] == [tuple(f[k] for k in key) for f in described]
    if previous["complete"] and same:
        return None
    manifest = dict(previous)
    manifest["inputs"] = previous["inputs"][:fixed] + described[fixed:]
    manifest["complete"] = False
    manifest["run"] = dict(previous["run"])
    return manifest


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
